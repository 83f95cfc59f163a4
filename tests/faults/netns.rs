//! A network namespace of the test's own with two `veth` links to the host's namespace, and a
//! partition of one of them. Only interfaces this module created are ever touched; everything
//! is deleted on drop, whatever the test's outcome.

use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

/// One `veth` pair: `host` in the host's namespace at `host_ip`, `inner` in the namespace at
/// `inner_ip`.
pub struct Link {
    pub host: String,
    pub inner: String,
    pub host_ip: Ipv4Addr,
    pub inner_ip: Ipv4Addr,
}

/// The namespace, its link to the store and its link to the clients.
pub struct Netns {
    pub name: String,
    pub store: Link,
    pub clients: Link,
}

fn run(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{args:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Netns {
    /// Creates it, or returns `None` after saying why the test skips (a panic under
    /// `IDEMPOTENT_REQUIRE_NETNS=1`).
    pub fn create() -> Option<Self> {
        let tag = idempotent_runtime::store::FencingToken::mint().0;
        // Interface names are at most 15 bytes; the subnets are /30s in 10.231/16 and 10.232/16.
        let id = format!("{:06x}", tag & 0xff_ffff);
        let subnet = |first: u8| {
            let n = (tag >> 24) as u16 & 0x3fff;
            let (c, d) = ((n >> 6) as u8, ((n & 0x3f) as u8) * 4);
            (
                Ipv4Addr::new(10, first, c, d + 1),
                Ipv4Addr::new(10, first, c, d + 2),
            )
        };
        let (store_host, store_inner) = subnet(231);
        let (client_host, client_inner) = subnet(232);
        let ns = Self {
            name: format!("idem-{id}"),
            store: Link {
                host: format!("ids{id}"),
                inner: format!("ids{id}n"),
                host_ip: store_host,
                inner_ip: store_inner,
            },
            clients: Link {
                host: format!("idc{id}"),
                inner: format!("idc{id}n"),
                host_ip: client_host,
                inner_ip: client_inner,
            },
        };
        if let Err(why) = run(&["ip", "netns", "add", &ns.name]) {
            assert!(
                std::env::var("IDEMPOTENT_REQUIRE_NETNS").as_deref() != Ok("1"),
                "IDEMPOTENT_REQUIRE_NETNS=1 but no network namespace could be made: {why}"
            );
            eprintln!("no network namespace ({why}): skipping the partition test");
            return None;
        }
        // From here on, drop deletes whatever was made.
        let setup = || -> Result<(), String> {
            run(&["ip", "-n", &ns.name, "link", "set", "lo", "up"])?;
            for link in [&ns.store, &ns.clients] {
                run(&[
                    "ip",
                    "link",
                    "add",
                    &link.host,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &link.inner,
                    "netns",
                    &ns.name,
                ])?;
                run(&[
                    "ip",
                    "addr",
                    "add",
                    &format!("{}/30", link.host_ip),
                    "dev",
                    &link.host,
                ])?;
                run(&["ip", "link", "set", &link.host, "up"])?;
                run(&[
                    "ip",
                    "-n",
                    &ns.name,
                    "addr",
                    "add",
                    &format!("{}/30", link.inner_ip),
                    "dev",
                    &link.inner,
                ])?;
                run(&["ip", "-n", &ns.name, "link", "set", &link.inner, "up"])?;
            }
            Ok(())
        };
        if let Err(why) = setup() {
            panic!("setting up network namespace {}: {why}", ns.name);
        }
        Some(ns)
    }

    /// The command line prefix that runs a program inside the namespace.
    pub fn exec(&self) -> [&str; 4] {
        ["ip", "netns", "exec", &self.name]
    }

    /// Drops every packet either way on the store's link (a `blackhole` qdisc on both ends'
    /// egress): TCP sees silence, not a reset, as across a real partition. (`tc netem loss
    /// 100%` would do the same; this machine's kernel has no `sch_netem`.)
    pub fn partition_store(&self) {
        run(&[
            "tc",
            "qdisc",
            "add",
            "dev",
            &self.store.host,
            "root",
            "blackhole",
        ])
        .unwrap();
        run(&[
            "tc",
            "-n",
            &self.name,
            "qdisc",
            "add",
            "dev",
            &self.store.inner,
            "root",
            "blackhole",
        ])
        .unwrap();
    }

    /// Ends the partition.
    pub fn heal_store(&self) {
        run(&["tc", "qdisc", "del", "dev", &self.store.host, "root"]).unwrap();
        run(&[
            "tc",
            "-n",
            &self.name,
            "qdisc",
            "del",
            "dev",
            &self.store.inner,
            "root",
        ])
        .unwrap();
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting one end of a veth pair deletes both.
        let _ = run(&["ip", "link", "del", &self.store.host]);
        let _ = run(&["ip", "link", "del", &self.clients.host]);
        let _ = run(&["ip", "netns", "del", &self.name]);
    }
}
