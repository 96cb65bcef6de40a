//! The connect hooks' per-socket record (`SOCK_REC`, keyed by socket
//! cookie) and its release at close: getpeername/recvmsg through
//! reconnects and `connect(AF_UNSPEC)`, the fallback to socket storage when
//! the map is full, adoption of a socket-storage datapath, every way a
//! socket closes leaving the map empty (an abort by the agent's
//! termination included, through both mechanisms), the start-up sweep of
//! records whose socket is gone, the counter array of an older build
//! migrated to the new size, and the record counts (`SOCK_REC_COUNT`) in
//! front of the map: back at 0 once every socket is gone, covering the
//! records of a build without them, and equal to the live records again
//! after a sweep deleted records or an adoption's uncounted records went.
//!
//! The socket work runs in a child: this test binary run again in the
//! node's cgroup and the pods' namespace (`command_in`), with
//! `TOPOPROXY_SOCK_REC_CHILD` naming the scenario; the child test
//! `child_scenario` does nothing otherwise. So the scenarios are the same
//! Rust code on every kernel, and the parent only reads the pinned maps.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::mem::size_of;
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::os::fd::RawFd;
use std::process::{Command, Stdio};

use aya::maps::{Array, HashMap, Map, MapData};
use proxy_agent::datapath::dump::socket_counter_sums;
use proxy_agent::datapath::pins;
use proxy_agent::datapath::socket_loader::RELEASE_PROGRAM;
use proxy_agent::datapath::sockets::sock_rec_count::{self, MappedCounts};
use proxy_agent::datapath::sockets::sock_rec_sweep;
use proxy_common::{
    SOCK_PEER_MAP, SOCK_REC_COUNT_FLAGS, SOCK_REC_COUNT_MAP, SOCK_REC_COUNT_SLOTS, SOCK_REC_COUNTED, SOCK_REC_MAP, SOCK_REC_UNCOUNTED,
    SOCK_REC_UNCOUNTED_ADDED, SockRecValue, counter, sock_rec_count_slot,
};
use proxy_test_support::sandbox::{Guarded, command_in, echo_server};
use proxy_test_support::wait::eventually;
use serde_json::{Value, json};
use support::*;

const CHILD_ENV: &str = "TOPOPROXY_SOCK_REC_CHILD";

/// One Service with a single endpoint per family (pod-c, pod-6b), so the
/// backend a socket reaches is known, on TCP 80 and UDP 53.
fn solo() -> String {
    ServiceSpec {
        name: "solo",
        cluster_ips: &["10.96.0.30", "fd00:96::30"],
        ports: &[("http", 80, "TCP", 8080), ("dns", 53, "UDP", 5353)],
        endpoints: &[("10.244.0.3", true, "node-a"), ("fd00:244::2", true, "node-a")],
        extra_spec: "",
        annotations: "",
    }
    .yaml()
}

/// One test at a time, whatever `--test-threads` says. On Linux 6.18 the
/// `sock_release` program was seen not to run for a socket closed while
/// other cgroups' programs were attached and detached (the other tests'
/// agents starting and stopping): about one socket in a run of this
/// binary, enough to leave a record that a test counts (see the
/// million-cycle test). Each test's records and counts are then its own.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn setup(extra: &[&str]) -> (PodNetwork, Node) {
    setup_with_env(extra, &[])
}

/// [`setup`], the agent started with `env` (e.g. the kernel probe's
/// `TOPOPROXY_KERNEL_HIDE`).
fn setup_with_env(extra: &[&str], env: &[(&str, &str)]) -> (PodNetwork, Node) {
    let mut net = PodNetwork::new();
    net.backend("pod-a", "10.244.0.1", &[8080, 5353]);
    net.backend("pod-c", "10.244.0.3", &[8080, 5353]);
    net.backend("pod-6a", "fd00:244::1", &[8080, 5353]);
    net.backend("pod-6b", "fd00:244::2", &[8080, 5353]);
    let mut node = Node::new("node-a");
    node.agent_env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    node.write_manifest("solo.yaml", &solo());
    node.start_agent_with(extra);
    wait_for_backends(&node, &net, "10.96.0.30:80", &[], &["pod-c"]);
    wait_for_backends(&node, &net, "10.96.0.30:53", &["--udp"], &["pod-c"]);
    wait_for_backends(&node, &net, "[fd00:96::30]:80", &[], &["pod-6b"]);
    wait_for_backends(&node, &net, "[fd00:96::30]:53", &["--udp"], &["pod-6b"]);
    (net, node)
}

/// The child: this binary in the node's cgroup and the pods' namespace.
fn child(node: &Node, net: &PodNetwork, scenario: &str) -> Command {
    let exe = std::env::current_exe().expect("test binary");
    let mut cmd = command_in(exe, Some(&net.netns), Some(&node.cgroup)).expect("child command");
    cmd.args(["--exact", "child_scenario", "--nocapture", "--test-threads", "1"]).env(CHILD_ENV, scenario);
    cmd
}

/// Runs a scenario to its end; its JSON lines.
fn run_child(node: &Node, net: &PodNetwork, scenario: &str) -> Vec<Value> {
    let out = child(node, net, scenario).stdin(Stdio::null()).stderr(Stdio::inherit()).output().expect("run child");
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout).lines().filter_map(json_line).collect();
    assert!(out.status.success(), "child {scenario} failed: {lines:?}");
    lines
}

/// A scenario's JSON line: libtest writes `test child_scenario ... ` before
/// the test runs, so the first one shares its line.
fn json_line(line: &str) -> Option<Value> {
    serde_json::from_str(&line[line.find('{')?..]).ok()
}

/// The pin of the release program's link.
fn release_link(node: &Node) -> std::path::PathBuf {
    pins::socket_link(node.pins.path(), RELEASE_PROGRAM)
}

fn records(node: &Node) -> Vec<(u64, SockRecValue)> {
    let data = MapData::from_pin(node.pins.path().join(SOCK_REC_MAP)).expect("open SOCK_REC");
    let map: HashMap<_, u64, SockRecValue> = HashMap::try_from(Map::HashMap(data)).expect("SOCK_REC");
    map.iter().filter_map(Result::ok).collect()
}

/// Every slot of `SOCK_REC_COUNT` that is not 0, with its count.
fn counted_slots(node: &Node) -> Vec<(u32, u64)> {
    let data = MapData::from_pin(node.pins.path().join(SOCK_REC_COUNT_MAP)).expect("open SOCK_REC_COUNT");
    let counts: Array<_, u64> = Array::try_from(Map::Array(data)).expect("SOCK_REC_COUNT");
    (0..SOCK_REC_COUNT_SLOTS).filter_map(|i| counts.get(&i, 0).ok().filter(|&c| c != 0).map(|c| (i, c))).collect()
}

/// What `SOCK_REC_COUNT` must hold for `records`: each slot the number of
/// its counted records, plus the mark of uncounted ones.
fn expected_slots(records: &[(u64, SockRecValue)]) -> Vec<(u32, u64)> {
    let mut want = std::collections::BTreeMap::<u32, u64>::new();
    for (cookie, r) in records {
        *want.entry(sock_rec_count_slot(*cookie)).or_default() += u64::from(r.counted == SOCK_REC_COUNTED);
    }
    let uncounted: std::collections::BTreeSet<u32> =
        records.iter().filter(|(_, r)| r.counted != SOCK_REC_COUNTED).map(|(c, _)| sock_rec_count_slot(*c)).collect();
    want.into_iter().map(|(s, n)| (s, if uncounted.contains(&s) { n + SOCK_REC_UNCOUNTED_ADDED } else { n })).collect()
}

/// `proxy-agent dump --output json` of the node's pins. Exit status 2
/// (findings) still prints the report.
/// Turns `records` into what a build without `SOCK_REC_COUNT` left: the
/// same records in SOCK_REC, without the `counted` mark.
fn unmark(node: &Node, records: &[(u64, SockRecValue)]) {
    let data = MapData::from_pin(node.pins.path().join(SOCK_REC_MAP)).expect("open SOCK_REC");
    let mut map: HashMap<_, u64, SockRecValue> = HashMap::try_from(Map::HashMap(data)).expect("SOCK_REC");
    for (k, v) in records {
        map.insert(k, SockRecValue { counted: 0, ..*v }, 0).expect("unmark a record");
    }
}

/// Waits until an upgraded agent has covered the slots of the uncounted
/// `records` in SOCK_REC_COUNT (pinned, each slot at least
/// `SOCK_REC_UNCOUNTED`).
fn wait_until_covered(node: &Node, records: &[(u64, SockRecValue)]) {
    eventually("the upgraded agent covered the records' slots", || {
        if !path_exists(&node.pins.path().join(SOCK_REC_COUNT_MAP)) {
            return Err("no SOCK_REC_COUNT yet".to_string());
        }
        let slots = counted_slots(node);
        let covered = records.iter().all(|(k, _)| slots.iter().any(|&(i, c)| i == sock_rec_count_slot(*k) && c >= SOCK_REC_UNCOUNTED));
        if covered { Ok(()) } else { Err(format!("slots {slots:?}")) }
    });
}

fn dump_json(node: &Node) -> Value {
    let dump = Command::new(agent_bin()).args(["dump", "--output", "json", "--bpffs"]).arg(node.pins.path()).output().expect("dump");
    serde_json::from_slice(&dump.stdout)
        .unwrap_or_else(|e| panic!("dump json ({e}); exit {}; stderr: {}", dump.status, String::from_utf8_lossy(&dump.stderr)))
}

fn counter_value(node: &Node, id: u32) -> u64 {
    socket_counter_sums(node.pins.path()).expect("counters").get(id as usize).copied().unwrap_or(0)
}

#[test]
fn getpeername_and_recvmsg_follow_reconnects_and_af_unspec_tcp_and_udp_v4_and_v6() {
    let _serial = serial();
    let (net, node) = setup(&[]);
    let lines = run_child(&node, &net, "reverse");
    let want = ["tcp4", "tcp6", "udp4", "udp6"];
    for w in want {
        assert!(lines.iter().any(|l| l["case"] == w && l["done"] == true), "case {w} did not finish: {lines:?}");
    }
    for l in &lines {
        assert_eq!(l["ok"], true, "{l}");
    }
    // Every socket of the child is closed: nothing left behind.
    assert_eq!(records(&node), Vec::new(), "every record is released with its socket");
}

#[test]
fn every_way_a_socket_closes_removes_its_record() {
    let _serial = serial();
    let (net, node) = setup(&[]);
    // A held socket of each kind, then the process exits without closing
    // them: the kernel releases them at exit.
    let held = Holder::start(&node, &net);
    let cookies = held.cookies.clone();
    let recorded: Vec<u64> = records(&node).iter().map(|r| r.0).collect();
    for c in &cookies {
        assert!(recorded.contains(c), "socket {c} is recorded while open: {recorded:?}");
    }
    // dump shows each with the path its connect took.
    let report = dump_json(&node);
    for c in &cookies {
        let found = report["sockets"]["records"].as_array().expect("records").iter().any(|r| r["cookie"] == *c && r["path"] == "sock_rec");
        assert!(found, "dump lists socket {c} on the sock_rec path: {}", report["sockets"]);
    }
    held.exit();
    assert_eq!(records(&node), Vec::new(), "process exit releases every socket");

    // close, shutdown then close, abort by RST (SO_LINGER 0), UDP close
    // and AF_UNSPEC then close, v4 and v6.
    run_child(&node, &net, "closes");
    assert_eq!(records(&node), Vec::new(), "every way of closing releases the record");
    assert_eq!(counted_slots(&node), Vec::new(), "every record's count is taken back with it");
}

/// A million translated connects, each closed at once: the release
/// program deletes every record, but for the rare release it does not
/// see, which the agent's periodic sweep deletes (`--sock-rec-sweep-interval-secs`,
/// here 1 s). Such a miss was seen in about one run in five of this test
/// binary on Linux 6.18, always one UDP socket in the middle of the run,
/// only while the binary's other tests attached and detached their
/// agents' programs on their own cgroups; with nothing else running, ten
/// runs in a row had none. Counting in the programs showed the release
/// program did not run for that socket (990,000 records inserted for the
/// UDP backend port, 989,999 releases of a socket with that peer port).
#[test]
fn a_million_connect_close_cycles_leave_the_map_empty() {
    let _serial = serial();
    let (net, node) = setup(&["--sock-rec-sweep-interval-secs", "1"]);
    let before = counter_value(&node, counter::TRANSLATED);
    let lines = run_child(&node, &net, "churn");
    let n = lines.last().and_then(|l| l["cycles"].as_u64()).expect("cycles");
    assert_eq!(n, 1_000_000);
    assert!(counter_value(&node, counter::TRANSLATED) - before >= n, "every cycle was translated");
    // Placed in the run by their cookies, if any is left.
    let range = lines.last().map(|l| (l["first_cookie"].clone(), l["last_cookie"].clone()));
    let left = records(&node);
    assert!(left.len() <= 2, "the release program deleted all but {} records (the run's cookies: {range:?}): {left:?}", left.len());
    if !left.is_empty() {
        eprintln!("records the release program did not delete (the run's cookies {range:?}): {left:?}");
    }
    eventually("the periodic sweep deletes what the release program left", || {
        let now = records(&node);
        if now.is_empty() { Ok(()) } else { Err(format!("{now:?}")) }
    });
    // The sweep takes back the count of each record it deletes (an atomic
    // subtraction through its mapping of the array), so every slot is
    // back at 0, those of swept records too.
    let swept = node.agent_log().lines().filter(|l| l.contains("releases the program did not see")).count();
    if swept > 0 {
        eprintln!("the agent's sweep deleted records of closed sockets {swept} time(s)");
    }
    assert_eq!(counted_slots(&node), Vec::new(), "and every slot of its counts is back at 0");
}

/// The sweep brings the counts back to the live records: records of
/// sockets that are gone (written here, with cookies no socket has, as a
/// release the program missed or a migration's copies would leave them),
/// counted or not, are deleted and their slots lowered, while the held
/// sockets' records and counts stay. The agent changes the slots with
/// atomic operations on its mapping of the array, which the programs'
/// atomic adds on other slots (the held sockets' connects) do not disturb.
#[test]
fn a_sweep_takes_back_the_counts_of_the_records_it_deletes() {
    let _serial = serial();
    let (net, node) = setup(&[]);
    let data = MapData::from_pin(node.pins.path().join(SOCK_REC_COUNT_MAP)).expect("open SOCK_REC_COUNT");
    assert_ne!(data.info().expect("map info").map_flags() & SOCK_REC_COUNT_FLAGS, 0, "SOCK_REC_COUNT is mappable");
    let mut held = Talker::start(&node, &net, "held-peers");
    assert_eq!(held.next()["ok"], true);
    let live = records(&node);
    assert_eq!(live.len(), 4, "{live:?}");
    assert_eq!(counted_slots(&node), expected_slots(&live), "the connects counted their records");

    // Stale records: counted ones (their slots raised as the connect
    // program raises them), two sharing a slot, and uncounted ones
    // covered as at an adoption.
    let counts = MappedCounts::open(node.pins.path()).expect("map SOCK_REC_COUNT").expect("mappable");
    let data = MapData::from_pin(node.pins.path().join(SOCK_REC_MAP)).expect("open SOCK_REC");
    let mut map: HashMap<_, u64, SockRecValue> = HashMap::try_from(Map::HashMap(data)).expect("SOCK_REC");
    let base = u64::MAX - 1000;
    // The last two share a slot.
    let stale_counted = [base, base + 1, base + 2, base + 2 - u64::from(SOCK_REC_COUNT_SLOTS)];
    for c in stale_counted {
        map.insert(c, SockRecValue { counted: SOCK_REC_COUNTED, ..SockRecValue::default() }, 0).expect("insert a stale record");
        counts.add(sock_rec_count_slot(c), 1);
    }
    let stale_uncounted = [base + 10, base + 11];
    for c in stale_uncounted {
        map.insert(c, SockRecValue::default(), 0).expect("insert an uncounted record");
    }
    assert_eq!(sock_rec_count::cover_uncounted(node.pins.path()).expect("cover"), 2);
    let with_stale = records(&node);
    assert_eq!(counted_slots(&node), expected_slots(&with_stale), "{with_stale:?}");
    assert!(counted_slots(&node).iter().any(|&(_, c)| c >= SOCK_REC_UNCOUNTED), "the uncounted records' slots are covered");

    let swept = sock_rec_sweep::sweep(node.pins.path()).expect("sweep");
    assert_eq!(swept.deleted, stale_counted.len() + stale_uncounted.len(), "{swept:?}");
    assert_eq!((swept.counts.taken_back, swept.counts.lowered), (stale_counted.len(), stale_uncounted.len()), "{swept:?}");
    let after = records(&node);
    assert_eq!(after, live, "only the held sockets' records are left");
    assert_eq!(counted_slots(&node), expected_slots(&after), "the counts equal the live records again");
    let peers = held.ask("peers");
    assert_eq!(peers["ok"], true, "the held sockets keep their getpeername and recvmsg: {peers}");
    held.exit();
    assert_eq!(records(&node), Vec::new());
    assert_eq!(counted_slots(&node), Vec::new(), "and their releases bring every slot back to 0");
}

/// An upgrade from a build without `SOCK_REC_COUNT`: its records carry no
/// `counted` mark and its pins no count map, so the new programs would
/// find their slots at 0. The agent raises those slots before and after
/// it swaps the programs in, so the sockets keep their getpeername and
/// recvmsg, and their release deletes the records.
#[test]
fn records_of_a_build_without_counts_keep_getpeername_and_are_released() {
    let _serial = serial();
    let (net, mut node) = setup(&[]);
    let mut held = Talker::start(&node, &net, "held-peers");
    let first = held.next();
    assert_eq!(first["ok"], true, "{first}");
    let held_records = records(&node);
    assert_eq!(held_records.len(), 4, "{held_records:?}");
    assert!(held_records.iter().all(|(_, r)| r.counted == proxy_common::SOCK_REC_COUNTED), "{held_records:?}");

    // What the older build's pins hold: the same records, unmarked, and
    // no count map. Its programs keep running until the new ones replace
    // them.
    node.stop_agent();
    unmark(&node, &held_records);
    std::fs::remove_file(node.pins.path().join(SOCK_REC_COUNT_MAP)).expect("remove SOCK_REC_COUNT pin");
    node.start_agent_with(&[]);
    wait_until_covered(&node, &held_records);
    wait_for_backends(&node, &net, "10.96.0.30:80", &[], &["pod-c"]);
    let after = held.ask("peers");
    assert_eq!(after["ok"], true, "sockets recorded by the older build keep their getpeername and recvmsg: {after}");
    held.exit();
    assert_eq!(records(&node), Vec::new(), "their release deletes the uncounted records");
    // No release takes an uncounted record's mark back: the next sweep
    // does, once its slot holds no uncounted record.
    assert!(counted_slots(&node).iter().all(|&(_, c)| c >= SOCK_REC_UNCOUNTED), "{:?}", counted_slots(&node));
    let swept = sock_rec_sweep::sweep(node.pins.path()).expect("sweep");
    assert!(swept.counts.lowered >= 1, "{swept:?}");
    assert_eq!(counted_slots(&node), Vec::new(), "after the adoption's records went, every slot is back at 0");
}

/// Pins of a build whose `SOCK_REC_COUNT` is not mappable (created without
/// `BPF_F_MMAPABLE`): the agent adopts the array as it is, covers the
/// uncounted records with a plain write of `SOCK_REC_UNCOUNTED`, and
/// leaves those slots raised (a lookup, never a wrong answer), since it
/// cannot change them atomically with the programs.
#[test]
fn an_older_count_array_that_cannot_be_mapped_is_kept_and_only_raised() {
    let _serial = serial();
    let (net, mut node) = setup(&[]);
    let mut held = Talker::start(&node, &net, "held-peers");
    assert_eq!(held.next()["ok"], true);
    let held_records = records(&node);
    assert_eq!(held_records.len(), 4, "{held_records:?}");
    node.stop_agent();
    unmark(&node, &held_records);
    let count_pin = node.pins.path().join(SOCK_REC_COUNT_MAP);
    std::fs::remove_file(&count_pin).expect("remove SOCK_REC_COUNT pin");
    let old: Array<MapData, u64> = Array::create(SOCK_REC_COUNT_SLOTS, 0).expect("create a count array without BPF_F_MMAPABLE");
    old.pin(&count_pin).expect("pin it");
    assert!(MappedCounts::open(node.pins.path()).expect("open").is_none(), "not mappable");

    node.start_agent_with(&[]);
    wait_until_covered(&node, &held_records);
    let data = MapData::from_pin(&count_pin).expect("open SOCK_REC_COUNT");
    assert_eq!(data.info().expect("map info").map_flags() & SOCK_REC_COUNT_FLAGS, 0, "the older array was adopted, not replaced");
    wait_for_backends(&node, &net, "10.96.0.30:80", &[], &["pod-c"]);
    let after = held.ask("peers");
    assert_eq!(after["ok"], true, "the covered records keep their getpeername and recvmsg: {after}");
    held.exit();
    assert_eq!(records(&node), Vec::new(), "their release deletes the uncounted records");
    let raised = counted_slots(&node);
    let swept = sock_rec_sweep::sweep(node.pins.path()).expect("sweep");
    assert_eq!(swept.counts, sock_rec_count::Settled::default(), "nothing is taken back without a mapping");
    assert_eq!(counted_slots(&node), raised, "the raised slots stay raised");
    assert!(raised.iter().all(|&(_, c)| c >= SOCK_REC_UNCOUNTED), "{raised:?}");
}

#[test]
fn a_full_map_falls_back_to_socket_storage_and_an_upgrade_keeps_those_sockets() {
    let _serial = serial();
    // A small map, filled from user space with cookies no socket has.
    let (net, mut node) = setup(&["--max-sock-revnat", "1024"]);
    let data = MapData::from_pin(node.pins.path().join(SOCK_REC_MAP)).expect("open SOCK_REC");
    let mut map: HashMap<_, u64, SockRecValue> = HashMap::try_from(Map::HashMap(data)).expect("SOCK_REC");
    let mut filled = Vec::new();
    for k in (u64::MAX - 100_000)..u64::MAX {
        if map.insert(k, SockRecValue::default(), 0).is_err() {
            break;
        }
        filled.push(k);
    }
    assert!(filled.len() >= 1024, "filled {}", filled.len());
    let full_before = counter_value(&node, counter::SOCK_RECORD_FULL);

    let mut held = Talker::start(&node, &net, "held-peers");
    let first = held.next();
    assert_eq!(first["ok"], true, "connects translate and getpeername shows the ClusterIP with SOCK_REC full: {first}");
    assert!(counter_value(&node, counter::SOCK_RECORD_FULL) - full_before >= 4, "each connect counted sock_record_full");
    let report = dump_json(&node);
    assert!(report["sockets"]["socketStorageFallbacks"].as_u64().unwrap_or(0) >= 4, "dump: {}", report["sockets"]);
    for k in &filled {
        map.remove(k).expect("empty SOCK_REC again");
    }
    drop(map);

    // The upgrade from the socket-storage build: its pins have no SOCK_REC
    // and no release link, and its sockets are recorded in SOCK_PEER, as
    // the held ones are.
    node.stop_agent();
    std::fs::remove_file(node.pins.path().join(SOCK_REC_MAP)).expect("remove SOCK_REC pin");
    std::fs::remove_file(release_link(&node)).expect("remove release link");
    assert!(node.pins.path().join(SOCK_PEER_MAP).exists());
    node.start_agent_with(&["--max-sock-revnat", "1024"]);
    // The old programs keep translating until the new ones replace them:
    // wait for the new datapath (SOCK_REC pinned again, the release link).
    eventually("the upgraded agent installed SOCK_REC and its release program", || {
        let ready = path_exists(&node.pins.path().join(SOCK_REC_MAP)) && path_exists(&release_link(&node));
        if ready { Ok(()) } else { Err("not yet".to_string()) }
    });
    wait_for_backends(&node, &net, "10.96.0.30:80", &[], &["pod-c"]);
    let after = held.ask("peers");
    assert_eq!(after["ok"], true, "sockets recorded before the upgrade keep their getpeername: {after}");
    held.exit();
    assert_eq!(records(&node), Vec::new());
}

/// A child running a scenario that answers on stdout, one JSON line per
/// request read from stdin; killed on drop (`Guarded`) if a test fails
/// before it is told to exit.
struct Talker {
    child: Guarded,
    stdin: std::process::ChildStdin,
    out: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl Talker {
    fn start(node: &Node, net: &PodNetwork, scenario: &str) -> Talker {
        let mut cmd = child(node, net, scenario);
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut child = Guarded::spawn(&mut cmd).expect("start child");
        let stdin = child.0.stdin.take().expect("stdin");
        let out = BufReader::new(child.0.stdout.take().expect("stdout")).lines();
        Talker { child, stdin, out }
    }

    /// The child's next JSON line.
    fn next(&mut self) -> Value {
        loop {
            let line = self.out.next().expect("child line").expect("read");
            if let Some(v) = json_line(&line) {
                return v;
            }
        }
    }

    /// Sends `request` and returns the answer.
    fn ask(&mut self, request: &str) -> Value {
        writeln!(self.stdin, "{request}").expect("ask child");
        self.next()
    }

    /// Tells the child to exit and checks that it did; its sockets are
    /// released as the process goes.
    fn exit(mut self) {
        writeln!(self.stdin, "exit").expect("tell child");
        assert!(self.child.0.wait().expect("child exit").success());
    }
}

/// A child holding the four sockets of the `hold` scenario (TCP/UDP,
/// v4/v6, connected to the Service), and their cookies.
struct Holder {
    talker: Talker,
    cookies: Vec<u64>,
}

impl Holder {
    fn start(node: &Node, net: &PodNetwork) -> Holder {
        let mut talker = Talker::start(node, net, "hold");
        let first = talker.next();
        let cookies: Vec<u64> = first["cookies"].as_array().expect("cookies").iter().filter_map(Value::as_u64).collect();
        assert_eq!(cookies.len(), 4, "{first}");
        Holder { talker, cookies }
    }

    /// Exits the child; its sockets are released as the process goes.
    fn exit(self) {
        self.talker.exit();
    }
}

fn recorded(node: &Node) -> Vec<u64> {
    records(node).iter().map(|r| r.0).collect()
}

/// Whether the kernel has the `bpf_sock_destroy` kfunc, so that the agent
/// terminates sockets through the BPF iterators (else through netlink).
fn has_sock_destroy_kfunc() -> bool {
    std::fs::read("/sys/kernel/btf/vmlinux").is_ok_and(|b| b.windows(18).any(|w| w == b"\0bpf_sock_destroy\0"))
}

/// A socket the agent aborts because its backend left loses its record at
/// the abort, while its owner still holds it open (it may never close
/// it): through the socket iterators where the kernel has
/// `bpf_sock_destroy`, and through netlink `SOCK_DESTROY` (the agent told
/// the kfunc is missing, as on kernels before 6.5).
#[test]
fn a_socket_destroyed_by_termination_loses_its_record() {
    let _serial = serial();
    let mut mechanisms = vec![("netlink", vec![("TOPOPROXY_KERNEL_HIDE", "sock_destroy_kfunc")])];
    if has_sock_destroy_kfunc() {
        mechanisms.push(("iterators", Vec::new()));
    }
    for (mechanism, env) in mechanisms {
        let (net, node) = setup_with_env(&[], &env);
        // The TCP port to echo servers that keep a connection open as long
        // as the client does: the hostname servers close theirs after one
        // answer, and both mechanisms leave a socket whose peer closed
        // (CLOSE_WAIT) alone.
        let _echo: Vec<_> = ["10.244.0.3:8081", "[fd00:244::2]:8081", "10.244.0.1:8081", "[fd00:244::1]:8081"]
            .map(|a| echo_server(&net.netns, sa(a)).expect("echo server"))
            .into_iter()
            .collect();
        let with = |eps: &[(&str, bool, &str)]| {
            ServiceSpec {
                name: "solo",
                cluster_ips: &["10.96.0.30", "fd00:96::30"],
                ports: &[("http", 80, "TCP", 8081), ("dns", 53, "UDP", 5353)],
                endpoints: eps,
                extra_spec: "",
                annotations: "",
            }
            .yaml()
        };
        node.write_manifest("solo.yaml", &with(&[("10.244.0.3", true, "node-a"), ("fd00:244::2", true, "node-a")]));
        eventually(&format!("{mechanism}: the Service on the echo port"), || {
            let text = dump_json(&node).to_string();
            if text.matches(":8081").count() >= 2 { Ok(()) } else { Err(text) }
        });
        let held = Holder::start(&node, &net);
        let before = recorded(&node);
        for c in &held.cookies {
            assert!(before.contains(c), "{mechanism}: socket {c} is recorded while connected: {before:?}");
        }
        // The held sockets' endpoint of each family terminating and no
        // longer serving (connected UDP is aborted), then gone (TCP is
        // too), while another endpoint takes over (a frontend left with no
        // backend ends nothing).
        let others = [("10.244.0.1", true, "node-a"), ("fd00:244::1", true, "node-a")];
        let mut terminating = with(&[others[0], others[1], ("10.244.0.3", true, "node-a"), ("fd00:244::2", true, "node-a")]);
        for ip in ["10.244.0.3", "fd00:244::2"] {
            let from = format!("- addresses: [\"{ip}\"]\n  conditions: {{ready: true}}");
            let to = format!("- addresses: [\"{ip}\"]\n  conditions: {{ready: false, serving: false, terminating: true}}");
            assert!(terminating.contains(&from), "{terminating}");
            terminating = terminating.replace(&from, &to);
        }
        node.write_manifest("solo.yaml", &terminating);
        let gone = with(&others);
        let udp_ended = || counter_value(&node, counter::ENDED_UDP_NOT_SERVING) + counter_value(&node, counter::ENDED_UDP_DELETED);
        eventually(&format!("{mechanism}: the UDP sockets aborted"), || if udp_ended() >= 2 { Ok(()) } else { Err(udp_ended()) });
        node.write_manifest("solo.yaml", &gone);
        eventually(&format!("{mechanism}: every held socket's record gone"), || {
            let now = recorded(&node);
            if held.cookies.iter().any(|c| now.contains(c)) { Err(now) } else { Ok(()) }
        });
        // The agent adds its terminations to the counters once the walk
        // is over, after the iterator program deleted the records.
        let tcp_ended = || counter_value(&node, counter::ENDED_TCP_GONE_AFTER_TERMINATING);
        eventually(&format!("{mechanism}: the TCP sockets aborted"), || if tcp_ended() >= 2 { Ok(()) } else { Err(tcp_ended()) });
        held.exit();
        assert_eq!(records(&node), Vec::new(), "{mechanism}");
        // The iterator program takes each record's count back as it
        // deletes it; netlink's deletes from user space leave theirs (a
        // slot that only ever answers "look up").
        if mechanism == "iterators" {
            assert_eq!(counted_slots(&node), Vec::new(), "{mechanism}: every count taken back with its record");
        }
    }
}

fn fake_records(node: &Node, n: u64) -> Vec<u64> {
    let data = MapData::from_pin(node.pins.path().join(SOCK_REC_MAP)).expect("open SOCK_REC");
    let mut map: HashMap<_, u64, SockRecValue> = HashMap::try_from(Map::HashMap(data)).expect("SOCK_REC");
    // Cookies count up from 1: these belong to no socket.
    let keys: Vec<u64> = (0..n).map(|i| u64::MAX - i).collect();
    for k in &keys {
        map.insert(*k, SockRecValue::default(), 0).expect("insert a record of no socket");
    }
    keys
}

fn sock_rec_capacity(node: &Node) -> u32 {
    aya::maps::MapInfo::from_pin(node.pins.path().join(SOCK_REC_MAP)).expect("SOCK_REC info").max_entries()
}

/// Records whose sockets went while no release program ran (its link
/// gone), and records a capacity migration copied for sockets gone by the
/// swap (stood in for by records of cookies no socket has), are deleted
/// by the sweep at the agent's start; live sockets keep theirs.
#[test]
fn records_of_sockets_gone_before_the_release_program_are_swept() {
    let _serial = serial();
    let (net, mut node) = setup_with_env(&["--max-sock-revnat", "1024"], &[("LOG_LEVEL", "info,proxy_agent::datapath=debug")]);
    let gone = Holder::start(&node, &net);
    let live = Holder::start(&node, &net);
    let (gone_cookies, live_cookies) = (gone.cookies.clone(), live.cookies.clone());

    // The release program detached (its link unpinned), then the first
    // child's sockets released. The kernel detaches a link whose last
    // reference went in a deferred work item (`bpf_link_put`), so the
    // release program may still have run for them: their records, read
    // before, are written back as a release that did not run leaves them.
    node.stop_agent();
    std::fs::remove_file(release_link(&node)).expect("remove release link");
    let before: Vec<(u64, SockRecValue)> = records(&node).into_iter().filter(|(c, _)| gone_cookies.contains(c)).collect();
    assert_eq!(before.len(), 4, "{before:?}");
    gone.exit();
    {
        let data = MapData::from_pin(node.pins.path().join(SOCK_REC_MAP)).expect("open SOCK_REC");
        let mut map: HashMap<_, u64, SockRecValue> = HashMap::try_from(Map::HashMap(data)).expect("SOCK_REC");
        for (c, v) in &before {
            map.insert(*c, *v, 0).expect("the record a missed release leaves");
        }
    }
    let fakes = fake_records(&node, 10);

    node.start_agent_with(&["--max-sock-revnat", "1024"]);
    eventually("the release link back and the records of closed sockets swept", || {
        let now = recorded(&node);
        let released = path_exists(&release_link(&node));
        if released && !gone_cookies.iter().chain(&fakes).any(|c| now.contains(c)) { Ok(()) } else { Err(now) }
    });
    let now = recorded(&node);
    assert!(live_cookies.iter().all(|c| now.contains(c)), "live sockets keep their records: {now:?} {live_cookies:?}");

    // A capacity migration copies SOCK_REC: records of no live socket in
    // the old map are swept from the new one.
    let fakes = fake_records(&node, 10);
    node.stop_agent();
    node.start_agent_with(&["--max-sock-revnat", "2048"]);
    eventually("SOCK_REC migrated to 2048 entries and swept", || {
        let now = recorded(&node);
        if sock_rec_capacity(&node) == 2048 && !fakes.iter().any(|c| now.contains(c)) { Ok(()) } else { Err(now) }
    });
    let now = recorded(&node);
    assert!(live_cookies.iter().all(|c| now.contains(c)), "live sockets keep their records across the migration: {now:?}");
    wait_for_backends(&node, &net, "10.96.0.30:80", &[], &["pod-c"]);
    live.exit();
    assert_eq!(records(&node), Vec::new());
}

/// A per-CPU array of u64 with `entries` entries pinned at `path`: the
/// counter array of an older build.
fn pin_counter_array(path: &std::path::Path, entries: u32) {
    const BPF_MAP_TYPE_PERCPU_ARRAY: u32 = 6;
    pin_new_map(path, BPF_MAP_TYPE_PERCPU_ARRAY, 4, 8, entries, 0);
}

/// A datapath pinned by a build with 16 socket counters (before
/// `sock_record_full`): the upgrade recreates the array at 17 entries with
/// the old counts carried over, and warns no more.
#[test]
fn a_counters_array_of_an_older_build_is_migrated_with_its_values() {
    let _serial = serial();
    use aya::maps::{PerCpuArray, PerCpuValues};
    let (net, mut node) = setup(&[]);
    node.stop_agent();
    let path = node.pins.path().join(proxy_common::COUNTERS_MAP);
    std::fs::remove_file(&path).expect("remove COUNTERS pin");
    pin_counter_array(&path, counter::COUNT - 1);
    let cpus = aya::util::nr_cpus().expect("possible CPUs");
    {
        let mut old: PerCpuArray<_, u64> =
            PerCpuArray::try_from(Map::PerCpuArray(MapData::from_pin(&path).expect("open old COUNTERS"))).expect("per-CPU array");
        let mut at_cpu0 = |i: u32, v: u64| {
            let mut values = vec![0u64; cpus];
            values[0] = v;
            old.set(i, PerCpuValues::try_from(values).expect("values"), 0).expect("set");
        };
        at_cpu0(counter::ENDED_TCP_GONE_AFTER_TERMINATING, 12_345);
        at_cpu0(counter::TRANSLATED, 777);
    }
    node.start_agent();
    eventually("COUNTERS migrated to the agent's size", || {
        let n = aya::maps::MapInfo::from_pin(&path).map(|i| i.max_entries()).map_err(|e| e.to_string())?;
        if n == counter::COUNT { Ok(()) } else { Err(format!("{n} entries")) }
    });
    assert_eq!(counter_value(&node, counter::ENDED_TCP_GONE_AFTER_TERMINATING), 12_345, "the old counts are carried over");
    // The old programs stay attached until the new ones replace them, and
    // they count into the array whose pin the test replaced: probe until
    // the new programs, attached after the migration, have counted
    // (a single round of probes once ran before they were, under load).
    eventually("the new programs count on top of the carried-over counts", || {
        wait_for_backends(&node, &net, "10.96.0.30:80", &[], &["pod-c"]);
        let translated = counter_value(&node, counter::TRANSLATED);
        if translated > 777 { Ok(()) } else { Err(translated) }
    });
    assert!(!node.agent_log().contains("counters, this agent has"), "no warning about the counter array");
}

// ---------------------------------------------------------------------
// The child side.

#[test]
fn child_scenario() {
    let Ok(scenario) = std::env::var(CHILD_ENV) else { return };
    match scenario.as_str() {
        "reverse" => reverse(),
        "hold" => hold(),
        "closes" => closes(),
        "churn" => churn(),
        "held-peers" => held_peers(),
        other => panic!("unknown scenario {other}"),
    }
}

fn say(v: Value) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{v}").expect("stdout");
    out.flush().expect("flush");
}

fn sa(s: &str) -> SocketAddr {
    s.parse().expect("address")
}

/// The peer the kernel reports (getpeername, through our hooks).
fn peer(fd: RawFd) -> Result<SocketAddr, i32> {
    // SAFETY: a zeroed sockaddr_storage is valid; getpeername writes at
    // most `len` bytes into it.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: as above.
    let rc = unsafe { libc::getpeername(fd, (&raw mut ss).cast(), &raw mut len) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
    }
    Ok(from_storage(&ss))
}

fn from_storage(ss: &libc::sockaddr_storage) -> SocketAddr {
    if i32::from(ss.ss_family) == libc::AF_INET {
        // SAFETY: the family says sockaddr_in.
        let sin = unsafe { &*(std::ptr::from_ref(ss).cast::<libc::sockaddr_in>()) };
        SocketAddr::new(IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes()), u16::from_be(sin.sin_port))
    } else {
        // SAFETY: the family says sockaddr_in6.
        let sin6 = unsafe { &*(std::ptr::from_ref(ss).cast::<libc::sockaddr_in6>()) };
        SocketAddr::new(IpAddr::from(sin6.sin6_addr.s6_addr), u16::from_be(sin6.sin6_port))
    }
}

fn storage(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: zeroed sockaddr_storage is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match a {
        SocketAddr::V4(v4) => {
            // SAFETY: sockaddr_storage is large enough and aligned for sockaddr_in.
            let sin = unsafe { &mut *((&raw mut ss).cast::<libc::sockaddr_in>()) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = v4.port().to_be();
            sin.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
            (ss, size_of::<libc::sockaddr_in>() as libc::socklen_t)
        }
        SocketAddr::V6(v6) => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 = unsafe { &mut *((&raw mut ss).cast::<libc::sockaddr_in6>()) };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = v6.port().to_be();
            sin6.sin6_addr.s6_addr = v6.ip().octets();
            (ss, size_of::<libc::sockaddr_in6>() as libc::socklen_t)
        }
    }
}

/// connect(2) on a raw socket; errno on failure.
fn connect(fd: RawFd, a: SocketAddr) -> Result<(), i32> {
    let (ss, len) = storage(a);
    // SAFETY: `ss` holds a sockaddr of `len` bytes.
    let rc = unsafe { libc::connect(fd, (&raw const ss).cast(), len) };
    if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0)) }
}

/// connect(AF_UNSPEC): dissolves the association (`inet_dgram_connect`,
/// `tcp_disconnect`); the connect hooks do not run for it.
fn disconnect(fd: RawFd) -> Result<(), i32> {
    // SAFETY: a zeroed sockaddr with family AF_UNSPEC.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    ss.ss_family = libc::AF_UNSPEC as libc::sa_family_t;
    // SAFETY: `ss` is a valid sockaddr buffer of that size.
    let rc = unsafe { libc::connect(fd, (&raw const ss).cast(), size_of::<libc::sockaddr>() as libc::socklen_t) };
    if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0)) }
}

fn socket(v6: bool, udp: bool) -> RawFd {
    let family = if v6 { libc::AF_INET6 } else { libc::AF_INET };
    let ty = if udp { libc::SOCK_DGRAM } else { libc::SOCK_STREAM };
    // SAFETY: plain socket(2).
    let fd = unsafe { libc::socket(family, ty | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    fd
}

fn close(fd: RawFd) {
    // SAFETY: `fd` is a socket this scenario opened and owns.
    unsafe { libc::close(fd) };
}

fn cookie(fd: RawFd) -> u64 {
    let mut c: u64 = 0;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: SO_COOKIE writes a u64.
    let rc = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_COOKIE, (&raw mut c).cast(), &raw mut len) };
    assert_eq!(rc, 0);
    c
}

/// Sends "ping" and reads the reply on a connected UDP socket: (reply,
/// source as recvfrom reports it).
fn udp_exchange(fd: RawFd) -> (String, SocketAddr) {
    // SAFETY: the socket is ours; borrowed for the exchange only.
    let sock = std::mem::ManuallyDrop::new(unsafe { <UdpSocket as std::os::fd::FromRawFd>::from_raw_fd(fd) });
    sock.set_read_timeout(Some(std::time::Duration::from_secs(5))).expect("timeout");
    sock.send(b"ping").expect("send");
    let mut buf = [0u8; 256];
    let (n, from) = sock.recv_from(&mut buf).expect("recv");
    (String::from_utf8_lossy(&buf[..n]).trim().to_string(), from)
}

/// Per family and protocol: translate, check getpeername (and recvmsg for
/// UDP), disconnect with AF_UNSPEC, reconnect straight to another pod
/// (reported as that pod), reconnect to the Service (reported as it).
fn reverse() {
    for (case, v6, udp) in [("tcp4", false, false), ("tcp6", true, false), ("udp4", false, true), ("udp6", true, true)] {
        let (svc, other) = match (v6, udp) {
            (false, false) => (sa("10.96.0.30:80"), sa("10.244.0.1:8080")),
            (true, false) => (sa("[fd00:96::30]:80"), sa("[fd00:244::1]:8080")),
            (false, true) => (sa("10.96.0.30:53"), sa("10.244.0.1:5353")),
            (true, true) => (sa("[fd00:96::30]:53"), sa("[fd00:244::1]:5353")),
        };
        let fd = socket(v6, udp);
        let mut checks = Vec::new();
        connect(fd, svc).expect("connect to the Service");
        checks.push(("connected: getpeername shows the Service", peer(fd) == Ok(svc)));
        if udp {
            let (_, from) = udp_exchange(fd);
            checks.push(("recvmsg shows the Service", from == svc));
        }
        disconnect(fd).expect("AF_UNSPEC");
        checks.push(("after AF_UNSPEC: not connected", peer(fd) == Err(libc::ENOTCONN)));
        connect(fd, other).expect("connect to a pod");
        checks.push(("reconnected to a pod: getpeername shows the pod", peer(fd) == Ok(other)));
        if udp {
            let (_, from) = udp_exchange(fd);
            checks.push(("recvmsg shows the pod", from == other));
        }
        disconnect(fd).expect("AF_UNSPEC");
        connect(fd, svc).expect("reconnect to the Service");
        checks.push(("reconnected to the Service: getpeername shows it", peer(fd) == Ok(svc)));
        if udp {
            let (_, from) = udp_exchange(fd);
            checks.push(("recvmsg shows the Service again", from == svc));
        } else {
            // A plain stream too, through the standard library.
            let s = TcpStream::connect(svc).expect("std connect");
            checks.push(("std TcpStream peer_addr shows the Service", s.peer_addr().ok() == Some(svc)));
        }
        close(fd);
        for (what, ok) in checks {
            say(json!({"case": case, "check": what, "ok": ok}));
        }
        say(json!({"case": case, "done": true, "ok": true}));
    }
}

/// Four sockets (TCP/UDP, v4/v6) connected to the Service, their cookies
/// printed; waits for "exit" and exits without closing them.
fn hold() {
    let mut fds = Vec::new();
    for (v6, udp) in [(false, false), (true, false), (false, true), (true, true)] {
        let to = match (v6, udp) {
            (false, false) => sa("10.96.0.30:80"),
            (true, false) => sa("[fd00:96::30]:80"),
            (false, true) => sa("10.96.0.30:53"),
            (true, true) => sa("[fd00:96::30]:53"),
        };
        let fd = socket(v6, udp);
        connect(fd, to).expect("connect");
        fds.push(fd);
    }
    say(json!({"cookies": fds.iter().map(|&fd| cookie(fd)).collect::<Vec<_>>()}));
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    // SAFETY: exit(2) at once, without running destructors or closing
    // descriptors: the kernel releases the sockets as the process goes.
    unsafe { libc::_exit(0) };
}

/// Every way of closing, for TCP and UDP, v4 and v6.
fn closes() {
    let set_linger0 = |fd: RawFd| {
        let l = libc::linger { l_onoff: 1, l_linger: 0 };
        // SAFETY: SO_LINGER reads a `linger`.
        let rc = unsafe { libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_LINGER, (&raw const l).cast(), size_of::<libc::linger>() as _) };
        assert_eq!(rc, 0);
    };
    for v6 in [false, true] {
        let (tcp, udp) = if v6 { (sa("[fd00:96::30]:80"), sa("[fd00:96::30]:53")) } else { (sa("10.96.0.30:80"), sa("10.96.0.30:53")) };
        // close.
        let fd = socket(v6, false);
        connect(fd, tcp).expect("connect");
        close(fd);
        // shutdown, then close.
        let fd = socket(v6, false);
        connect(fd, tcp).expect("connect");
        // SAFETY: our socket.
        unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
        close(fd);
        // abort by RST: SO_LINGER 0 makes close() send an RST (tcp_close
        // -> tcp_disconnect path).
        let fd = socket(v6, false);
        connect(fd, tcp).expect("connect");
        set_linger0(fd);
        close(fd);
        // UDP: close, and AF_UNSPEC first (the peer zeroed before the
        // release, cilium/cilium#42649).
        let fd = socket(v6, true);
        connect(fd, udp).expect("connect");
        close(fd);
        let fd = socket(v6, true);
        connect(fd, udp).expect("connect");
        disconnect(fd).expect("AF_UNSPEC");
        close(fd);
    }
    say(json!({"ok": true}));
}

/// A million translated connects, each closed at once: UDP connect()
/// (the cheapest translated connect) and non-blocking TCP connects (the
/// close sends an RST to the SYN's answer), v4 and v6.
fn churn() {
    let targets = [(false, true, sa("10.96.0.30:53")), (true, true, sa("[fd00:96::30]:53"))];
    let tcp = [(false, sa("10.96.0.30:80")), (true, sa("[fd00:96::30]:80"))];
    let mut n: u64 = 0;
    // The cookies of the first and last sockets: a record left behind is
    // placed in the run by its cookie.
    let (mut first, mut last) = (0, 0);
    while n < 1_000_000 {
        let fd = if n % 100 == 99 {
            let (v6, to) = tcp[(n as usize / 100) % 2];
            let fd = socket(v6, false);
            // SAFETY: our socket; O_NONBLOCK so connect() returns at once.
            unsafe { libc::fcntl(fd, libc::F_SETFL, libc::O_NONBLOCK) };
            let r = connect(fd, to);
            assert!(r.is_ok() || r == Err(libc::EINPROGRESS), "{r:?}");
            fd
        } else {
            let (v6, udp, to) = targets[n as usize % 2];
            let fd = socket(v6, udp);
            connect(fd, to).expect("connect");
            fd
        };
        if n == 0 {
            first = cookie(fd);
        } else if n == 999_999 {
            last = cookie(fd);
        }
        close(fd);
        n += 1;
    }
    say(json!({"cycles": n, "first_cookie": first, "last_cookie": last}));
}

/// Four held sockets; prints whether every getpeername shows the Service,
/// on start and on each "peers" line; exits on "exit".
fn held_peers() {
    let targets = [
        (false, false, sa("10.96.0.30:80")),
        (true, false, sa("[fd00:96::30]:80")),
        (false, true, sa("10.96.0.30:53")),
        (true, true, sa("[fd00:96::30]:53")),
    ];
    let mut fds = Vec::new();
    for (v6, udp, to) in targets {
        let fd = socket(v6, udp);
        connect(fd, to).expect("connect");
        fds.push((fd, to, udp));
    }
    let report = |fds: &[(RawFd, SocketAddr, bool)]| {
        let mut seen = Vec::new();
        let mut ok = true;
        for &(fd, to, udp) in fds {
            let p = peer(fd);
            ok &= p == Ok(to);
            if udp {
                let (_, from) = udp_exchange(fd);
                ok &= from == to;
                seen.push(format!("{p:?} recv {from}"));
            } else {
                seen.push(format!("{p:?}"));
            }
        }
        say(json!({"ok": ok, "peers": seen}));
    };
    report(&fds);
    for line in std::io::stdin().lock().lines() {
        match line.as_deref() {
            Ok("peers") => report(&fds),
            _ => break,
        }
    }
    for (fd, _, _) in fds {
        close(fd);
    }
}
