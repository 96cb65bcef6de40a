{{/*
Names and labels shared by every object of the chart.
*/}}

{{- define "topoproxy.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Full name: release name, plus the chart name unless the release already
contains it. Truncated to 63 characters because some Kubernetes name fields
are limited to that (DNS-1123 labels).
*/}}
{{- define "topoproxy.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "topoproxy.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels that never change over a release's life: safe for selectors. */}}
{{- define "topoproxy.selectorLabels" -}}
app.kubernetes.io/name: {{ include "topoproxy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "topoproxy.labels" -}}
helm.sh/chart: {{ include "topoproxy.chart" . }}
{{ include "topoproxy.selectorLabels" . }}
app.kubernetes.io/version: {{ include "topoproxy.imageTag" . | quote }}
app.kubernetes.io/component: agent
app.kubernetes.io/part-of: topoproxy
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "topoproxy.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "topoproxy.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "topoproxy.imageTag" -}}
{{- .Values.image.tag | default .Chart.AppVersion -}}
{{- end -}}

{{- define "topoproxy.image" -}}
{{- printf "%s:%s" .Values.image.repository (include "topoproxy.imageTag" .) -}}
{{- end -}}

{{/* Where the agent pins its maps and links. */}}
{{- define "topoproxy.pinPath" -}}
{{- printf "%s/%s" (.Values.bpf.root | trimSuffix "/") .Values.bpf.pinDir -}}
{{- end -}}

{{/*
Where the host's cgroup v2 root appears inside the agent container. A path
of its own, so that it is never confused with the container's own
/sys/fs/cgroup (a cgroup namespace shows only the pod's subtree there).
*/}}
{{- define "topoproxy.cgroupMount" -}}
/run/topoproxy/cgroup
{{- end -}}

{{/*
Whether the ServiceMonitor is rendered: `enabled: true` always, "auto"
where the cluster serves the API (the CRD is installed), false never.
*/}}
{{- define "topoproxy.serviceMonitor" -}}
{{- $on := .Values.metrics.serviceMonitor.enabled -}}
{{- if eq (toString $on) "true" -}}
true
{{- else if and (eq (toString $on) "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor") -}}
true
{{- end -}}
{{- end -}}

{{/* Whether the metrics Service is rendered. */}}
{{- define "topoproxy.metricsService" -}}
{{- if or .Values.metrics.service.enabled (include "topoproxy.serviceMonitor" .) -}}
true
{{- end -}}
{{- end -}}

{{/*
The address /metrics is served on: metrics.bindAddress, or (when empty)
loopback, as kube-proxy's --metrics-bind-address default, unless the
metrics Service or the ServiceMonitor needs it reachable from Prometheus.
*/}}
{{- define "topoproxy.metricsBindAddress" -}}
{{- $ip := .Values.metrics.bindAddress | default "" -}}
{{- $scraped := include "topoproxy.metricsService" . -}}
{{- if not $ip -}}
{{- $ip = ternary "0.0.0.0" "127.0.0.1" (eq $scraped "true") -}}
{{- else if and $scraped (or (hasPrefix "127." $ip) (eq $ip "::1") (eq $ip "localhost")) -}}
{{- fail (printf "metrics.bindAddress %s is loopback, which the metrics Service and ServiceMonitor cannot reach: leave it empty (0.0.0.0 then) or give an address Prometheus reaches" $ip) -}}
{{- end -}}
{{- include "topoproxy.ipPort" (list $ip .Values.metrics.port) -}}
{{- end -}}

{{/* IP:port, an IPv6 address in brackets, as the agent's flags take it. */}}
{{- define "topoproxy.ipPort" -}}
{{- $ip := index . 0 -}}
{{- if contains ":" $ip -}}[{{ $ip }}]{{- else -}}{{ $ip }}{{- end -}}:{{ int64 (index . 1) }}
{{- end -}}
