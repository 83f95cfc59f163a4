//! Network namespaces of the test's own, one per replica, each with two `veth` links to the
//! host's namespace, and a partition of one of them. Only interfaces this module created are ever
//! touched; everything is deleted on drop, whatever the test's outcome.

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

/// A namespace, its link to the store and its link to the clients.
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
    /// Two namespaces, `a` and `b`, whose subnets never collide with each other, or `None`
    /// after saying why the test skips (a panic under `IDEMPOTENT_REQUIRE_NETNS=1`).
    ///
    /// The subnets are /30s in 10.231/16 (store links) and 10.232/16 (client links), numbered
    /// by a 14-bit slot from a random token: `a` takes an even slot and `b` the odd one after it,
    /// so the pair's four /30s are distinct by construction (and another pair's either all
    /// collide with them, failing its `ip addr add`, or none do).
    pub fn pair() -> Option<(Self, Self)> {
        let tag = idempotent_runtime::store::FencingToken::mint().0;
        // Interface names are at most 15 bytes: `ids` + 6 hex digits + the replica + `n`.
        let id = format!("{:06x}", tag & 0xff_ffff);
        let slot = (tag >> 24) as u16 & 0x3ffe;
        let a = Self::named(&id, 'a', slot);
        if let Err(why) = run(&["ip", "netns", "add", &a.name]) {
            assert!(
                std::env::var("IDEMPOTENT_REQUIRE_NETNS").as_deref() != Ok("1"),
                "IDEMPOTENT_REQUIRE_NETNS=1 but no network namespace could be made: {why}"
            );
            eprintln!("no network namespace ({why}): skipping the partition test");
            return None;
        }
        // From here on, dropping `a` (and `b` once added) deletes whatever was made.
        if let Err(why) = a.set_up() {
            panic!("setting up network namespace {}: {why}", a.name);
        }
        let b = Self::named(&id, 'b', slot | 1);
        if let Err(why) = run(&["ip", "netns", "add", &b.name]).and_then(|()| b.set_up()) {
            panic!("setting up network namespace {}: {why}", b.name);
        }
        Some((a, b))
    }

    /// The names and addresses of replica `replica`'s namespace in subnet slot `slot`.
    fn named(id: &str, replica: char, slot: u16) -> Self {
        let (c, d) = ((slot >> 6) as u8, ((slot & 0x3f) as u8) * 4);
        let link = |kind: char, second: u8| Link {
            host: format!("id{kind}{id}{replica}"),
            inner: format!("id{kind}{id}{replica}n"),
            host_ip: Ipv4Addr::new(10, second, c, d + 1),
            inner_ip: Ipv4Addr::new(10, second, c, d + 2),
        };
        Self {
            name: format!("idem-{id}-{replica}"),
            store: link('s', 231),
            clients: link('c', 232),
        }
    }

    /// Its loopback and both links, up and addressed (the namespace exists).
    fn set_up(&self) -> Result<(), String> {
        run(&["ip", "-n", &self.name, "link", "set", "lo", "up"])?;
        for link in [&self.store, &self.clients] {
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
                &self.name,
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
                &self.name,
                "addr",
                "add",
                &format!("{}/30", link.inner_ip),
                "dev",
                &link.inner,
            ])?;
            run(&["ip", "-n", &self.name, "link", "set", &link.inner, "up"])?;
        }
        Ok(())
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
