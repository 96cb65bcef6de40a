//! Where the cluster comes from: manifest files, or the API server's
//! list/watch. Both convert objects with the same functions (`delta`,
//! `objects`, from the slim `wire` shapes) and fill the same queue
//! (`feed`) that the sync loop drains.

pub(crate) mod delta;
pub mod feed;
pub mod kube_watch;
pub mod manifest;
pub mod manifest_watch;
pub(crate) mod objects;
pub(crate) mod wire;
