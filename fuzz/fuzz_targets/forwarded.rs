//! `scope::client_ip` (DESIGN.md §4 "Forwarded headers are read as bytes") on arbitrary bytes a
//! client writes behind a trusted proxy that appends its hop: the address is always the hop the
//! proxy appended, or the request is refused; never anything the client wrote. On wholly
//! arbitrary header lines it never panics, and an untrusted peer is always its own client.
#![no_main]

use std::net::IpAddr;

use arbitrary::Arbitrary;
use idempotent_runtime::scope::ScopeError;
use idempotent_runtime::test_helpers::scope::client_ip;
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Appended {
    /// The proxy's hop is the client's address (`198.51.100.9`).
    Client,
    /// The proxy's hop, then a second trusted proxy's hop (`198.51.100.9, 10.0.0.3`).
    ClientBehindTwoProxies,
    /// The proxy's hop is not an address (`unknown`): refused, whatever came before.
    Unknown,
}

#[derive(Arbitrary, Debug)]
struct Input {
    /// What the client wrote in its own `X-Forwarded-For` line, before the proxy appended.
    client_xff: Vec<u8>,
    /// `X-Forwarded-For` lines the client sent besides.
    earlier_xff: Vec<Vec<u8>>,
    /// The client's own `Forwarded` lines.
    forwarded: Vec<Vec<u8>>,
    appended: Appended,
    /// The proxy appends to `Forwarded` instead, and no `X-Forwarded-For` line is sent.
    rfc7239: bool,
}

const CLIENT: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(198, 51, 100, 9));

fuzz_target!(|input: Input| {
    let proxies = ["10.0.0.0/8".parse().unwrap()];
    let proxy: IpAddr = "10.1.1.1".parse().unwrap();
    let appended: &[u8] = match (&input.appended, input.rfc7239) {
        (Appended::Client, false) => b"198.51.100.9",
        (Appended::ClientBehindTwoProxies, false) => b"198.51.100.9, 10.0.0.3",
        (Appended::Unknown, false) => b"unknown",
        (Appended::Client, true) => b"for=198.51.100.9;proto=https",
        (Appended::ClientBehindTwoProxies, true) => b"for=\"198.51.100.9:80\", for=10.0.0.3",
        (Appended::Unknown, true) => b"for=unknown",
    };
    let mut last = input.client_xff.clone();
    last.extend_from_slice(b", ");
    last.extend_from_slice(appended);
    let expected = match input.appended {
        Appended::Unknown => Err(ScopeError::ProxyWithoutClientAddress),
        _ => Ok(CLIENT),
    };

    let earlier = input.earlier_xff.iter().map(Vec::as_slice);
    let forwarded = input.forwarded.iter().map(Vec::as_slice);
    let got = if input.rfc7239 {
        // Only Forwarded: the client's lines first, the proxy's appended element last.
        let fwd = forwarded.chain([last.as_slice()]);
        client_ip(proxy, [], fwd, &proxies)
    } else {
        let xff = earlier.chain([last.as_slice()]);
        client_ip(proxy, xff, forwarded, &proxies)
    };
    assert_eq!(got, expected, "{input:?}");

    // Wholly arbitrary lines: no panic; an untrusted peer is the client whatever it sends.
    let xff = input.earlier_xff.iter().map(Vec::as_slice);
    let fwd = input.forwarded.iter().map(Vec::as_slice);
    let _ = client_ip(proxy, xff.clone(), fwd.clone(), &proxies);
    let untrusted: IpAddr = "203.0.113.1".parse().unwrap();
    assert_eq!(client_ip(untrusted, xff, fwd, &proxies), Ok(untrusted));
});
