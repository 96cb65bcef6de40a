//! Maglev lookup tables in the maps (`maglev_tables`: writing each
//! frontend's table into `NP_MAGLEV`/`SOCK_MAGLEV`), within the memory the
//! agent allows them (`maglev_budget`). The tables themselves are computed
//! in `decide::maglev`.

pub mod maglev_budget;
pub mod maglev_tables;
