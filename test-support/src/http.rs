//! The agent's health and metrics endpoints as a client sees them: one
//! plain HTTP GET, and one sample read out of a Prometheus text exposition.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A plain HTTP/1.0 GET on loopback: (status code, body). HTTP/1.0 without
/// keep-alive makes the server close the connection after the response, so
/// the body is everything up to EOF.
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").map_err(|e| e.to_string())?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).map_err(|e| e.to_string())?;
    let code = buf.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or(format!("bad response {buf:?}"))?;
    let body = buf.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((code, body))
}

/// The value of one sample line of a Prometheus exposition, e.g.
/// `topoproxy_errors_total{reason="watch_expired"}`.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l[series.len()..].split_whitespace().next()?.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::metric;

    #[test]
    fn reads_one_series_and_not_its_prefix_twins() {
        let text = "# TYPE topoproxy_syncs_total counter\n\
                    topoproxy_syncs_total 7\n\
                    topoproxy_syncs_total_extra 9\n\
                    topoproxy_errors_total{reason=\"map_full\"} 2\n";
        assert_eq!(metric(text, "topoproxy_syncs_total"), Some(7.0));
        assert_eq!(metric(text, "topoproxy_errors_total{reason=\"map_full\"}"), Some(2.0));
        assert_eq!(metric(text, "topoproxy_errors_total"), None);
    }
}
