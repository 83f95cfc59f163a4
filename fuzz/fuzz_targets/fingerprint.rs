//! The request fingerprint (DESIGN.md §4) on arbitrary requests: deterministic, invariant under
//! reordering query pairs (keeping the order of pairs that share a name), and changed by every
//! change that matters, absent-versus-empty and bytes moved across a segment boundary included.
#![no_main]

use std::net::IpAddr;

use arbitrary::Arbitrary;
use idempotent_runtime::fingerprint::FingerprintInput;
use idempotent_runtime::test_helpers::fingerprint::{compute, compute_version};
use idempotent_runtime::scope::{ClientId, Identity, Scope};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Request {
    method: String,
    route: Option<String>,
    path_params: Vec<String>,
    query: Option<String>,
    tenant: Option<String>,
    subject: Option<String>,
    api_key: Option<String>,
    peer: [u8; 4],
    content_type: Option<Vec<u8>>,
    body: Vec<u8>,
    /// One rank per distinct query name: the order the pairs are shuffled into.
    ranks: Vec<u8>,
}

fuzz_target!(|r: Request| {
    let identity = Identity {
        tenant: r.tenant.clone(),
        subject: r.subject.clone(),
        client: r.api_key.clone().map(ClientId::ApiKey),
    };
    let scope = Scope::from_identity(&identity, Some(IpAddr::from(r.peer))).expect("peer given");
    let params: Vec<&str> = r.path_params.iter().map(String::as_str).collect();
    let input = FingerprintInput {
        method: &r.method,
        route: r.route.as_deref(),
        path_params: &params,
        query: r.query.as_deref(),
        scope: &scope,
        content_type: r.content_type.as_deref(),
        body: &r.body,
    };
    let fp = compute(&input, None);
    assert_eq!(fp, compute(&input, None), "not deterministic");
    assert_eq!(compute_version(1, &input, None), Some(fp));
    assert_eq!(compute_version(2, &input, None), None);

    // Query pairs in another order, pairs of one name keeping theirs: the same fingerprint.
    if let Some(query) = r.query.as_deref().filter(|q| !q.is_empty()) {
        let pairs: Vec<&str> = query.split('&').collect();
        let mut names: Vec<&str> = Vec::new();
        for p in &pairs {
            let name = p.split_once('=').map_or(*p, |(n, _)| n);
            if !names.contains(&name) {
                names.push(name);
            }
        }
        let rank = |p: &&str| {
            let name = p.split_once('=').map_or(*p, |(n, _)| n);
            let i = names.iter().position(|n| *n == name).expect("seen");
            // Without ranks from the input, reverse the names: a shuffle that is usually the
            // identity would check nothing.
            r.ranks
                .get(i)
                .copied()
                .unwrap_or((names.len() - i).min(255) as u8)
        };
        let mut shuffled = pairs.clone();
        shuffled.sort_by_key(rank);
        let shuffled = shuffled.join("&");
        let other = FingerprintInput {
            query: Some(&shuffled),
            ..input
        };
        assert_eq!(
            compute(&other, None),
            fp,
            "query order changed the fingerprint: {query:?} vs {shuffled:?}"
        );
        // `a` and `a=` are different pairs.
        if let Some(bare) = pairs.iter().find(|p| !p.contains('=')) {
            let with_eq = pairs
                .iter()
                .map(|p| {
                    if p == bare {
                        format!("{p}=")
                    } else {
                        (*p).to_owned()
                    }
                })
                .collect::<Vec<_>>()
                .join("&");
            let other = FingerprintInput {
                query: Some(&with_eq),
                ..input
            };
            assert_ne!(compute(&other, None), fp, "`a` and `a=` collide");
        }
    }

    // Absent and empty differ.
    if r.query.is_none() {
        assert_ne!(
            compute(
                &FingerprintInput {
                    query: Some(""),
                    ..input
                },
                None
            ),
            fp,
            "absent vs empty query"
        );
    }
    if r.content_type.is_none() {
        assert_ne!(
            compute(
                &FingerprintInput {
                    content_type: Some(b""),
                    ..input
                },
                None
            ),
            fp,
            "absent vs empty content type"
        );
    }
    if r.route.is_none() {
        assert_ne!(
            compute(
                &FingerprintInput {
                    route: Some(""),
                    ..input
                },
                None
            ),
            fp,
            "absent vs empty route"
        );
    }

    // Changes that matter change it.
    let mut body = r.body.clone();
    body.push(0);
    assert_ne!(
        compute(
            &FingerprintInput {
                body: &body,
                ..input
            },
            None
        ),
        fp,
        "body change"
    );
    let mut more = params.clone();
    more.push("");
    assert_ne!(
        compute(
            &FingerprintInput {
                path_params: &more,
                ..input
            },
            None
        ),
        fp,
        "path param count"
    );
    // A byte moved from the method into the route (framing, not concatenation).
    if let (Some(last), Some(route)) = (r.method.chars().last(), r.route.as_deref()) {
        let method = &r.method[..r.method.len() - last.len_utf8()];
        let route = format!("{last}{route}");
        let moved = FingerprintInput {
            method,
            route: Some(&route),
            ..input
        };
        assert_ne!(compute(&moved, None), fp, "segment boundary is not framed");
    }
    // Every segment, changed, changes the digest.
    let differs = |other: &FingerprintInput<'_>, what: &str| {
        assert_ne!(compute(other, None), fp, "changing the {what} kept the digest");
    };
    let method = format!("{}X", r.method);
    differs(
        &FingerprintInput {
            method: &method,
            ..input
        },
        "method",
    );
    let route = format!("{}/x", r.route.as_deref().unwrap_or(""));
    differs(
        &FingerprintInput {
            route: Some(&route),
            ..input
        },
        "route",
    );
    for i in 0..params.len() {
        let changed = format!("{}x", params[i]);
        let mut other = params.clone();
        other[i] = &changed;
        differs(
            &FingerprintInput {
                path_params: &other,
                ..input
            },
            "value of a path parameter",
        );
    }
    let query = match r.query.as_deref() {
        Some(q) => format!("{q}&zz=1"),
        None => "zz=1".to_owned(),
    };
    differs(
        &FingerprintInput {
            query: Some(&query),
            ..input
        },
        "query",
    );
    let mut content_type = r.content_type.clone().unwrap_or_default();
    content_type.push(b'x');
    differs(
        &FingerprintInput {
            content_type: Some(&content_type),
            ..input
        },
        "content type",
    );
    let bump = |v: &Option<String>| Some(format!("{}x", v.as_deref().unwrap_or("")));
    for (what, other) in [
        (
            "tenant",
            Identity {
                tenant: bump(&r.tenant),
                ..identity.clone()
            },
        ),
        (
            "subject",
            Identity {
                subject: bump(&r.subject),
                ..identity.clone()
            },
        ),
        (
            "client id",
            Identity {
                client: bump(&r.api_key).map(ClientId::ApiKey),
                ..identity.clone()
            },
        ),
    ] {
        let scope = Scope::from_identity(&other, Some(IpAddr::from(r.peer))).expect("peer given");
        differs(
            &FingerprintInput {
                scope: &scope,
                ..input
            },
            what,
        );
    }
    if r.subject.is_none() && r.api_key.is_none() {
        let mut peer = r.peer;
        peer[3] ^= 1;
        let scope = Scope::from_identity(&identity, Some(IpAddr::from(peer))).expect("peer given");
        differs(
            &FingerprintInput {
                scope: &scope,
                ..input
            },
            "anonymous caller's peer address",
        );
    }

    // Another scope, another fingerprint.
    let stranger = Identity::client(ClientId::ApiKey(format!(
        "{}x",
        r.api_key.as_deref().unwrap_or("")
    )));
    let stranger = Scope::from_identity(&stranger, None).expect("client id");
    if stranger != scope {
        assert_ne!(
            compute(
                &FingerprintInput {
                    scope: &stranger,
                    ..input
                },
                None
            ),
            fp,
            "scope ignored"
        );
    }
});
