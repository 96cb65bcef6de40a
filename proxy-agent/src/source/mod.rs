//! Where the cluster comes from: manifest files, or the API server's
//! list/watch. Both convert objects with the same functions (`delta`,
//! `objects`, from the slim `wire` shapes; `wire_v1beta1` for the
//! EndpointSlices of 1.17-1.24 API servers) and fill the same queue
//! (`feed`) that the sync loop drains. `api_versions` negotiates which
//! versions the watchers and the Event poster use. `node_scope` says what
//! the Node watch keeps of other Nodes, for it and for `explain`.
//!
//! Manifests: `manifest` lists the files and streams each one's objects
//! (`manifest_json` item by item, `manifest_yaml` document by document),
//! `manifest_set` keeps which file holds which object and reads only the
//! files that changed, and `manifest_watch` runs it on inotify events.

pub mod api_versions;
pub(crate) mod delta;
pub mod feed;
pub mod kube_watch;
pub mod manifest;
pub(crate) mod manifest_json;
pub(crate) mod manifest_set;
pub mod manifest_watch;
pub(crate) mod manifest_yaml;
pub mod node_scope;
pub(crate) mod objects;
pub(crate) mod wire;
pub(crate) mod wire_v1beta1;
