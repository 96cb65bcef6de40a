//! External traffic (NodePort, LoadBalancer, externalIPs): the node's
//! addresses and devices, the TC datapath's writer, and the health check
//! node ports of `externalTrafficPolicy: Local` Services.

pub(crate) mod health_check;
pub mod node_addresses;
pub mod nodeport;
pub mod peer_devices;
