//! Who the caller is: the identity the application publishes, and the scope hash derived from it
//! ([the contract](crate::design) §4).
//!
//! The scope is SHA-256 of the fingerprint's segments 5–7 (tenant, subject, client id) and leads
//! every store key, so one tenant guessing another's key is a miss, never a replay of somebody
//! else's response.

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use sha2::{Digest, Sha256};

use crate::digest::Encoder;

/// SHA-256 of the scope segments.
pub type ScopeHash = [u8; 32];

/// The identity of a caller, published by the application's authentication (middleware or
/// extractor) into the request extensions, or returned by a resolver set on the runtime.
///
/// ```
/// use idempotent_runtime::scope::{ClientId, Identity};
///
/// let user = Identity::subject("acme", "user-17");
/// let machine = Identity::client(ClientId::ApiKey("key-9".into())).with_tenant("acme");
/// assert_ne!(user, machine);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Identity {
    /// The tenant (organisation, account) the caller acts for.
    pub tenant: Option<String>,
    /// The authenticated end user.
    pub subject: Option<String>,
    /// The calling application.
    pub client: Option<ClientId>,
}

impl Identity {
    /// A user of a tenant.
    pub fn subject(tenant: impl Into<String>, subject: impl Into<String>) -> Self {
        Self {
            tenant: Some(tenant.into()),
            subject: Some(subject.into()),
            client: None,
        }
    }

    /// A calling application without an end user.
    pub fn client(client: ClientId) -> Self {
        Self {
            client: Some(client),
            ..Self::default()
        }
    }

    /// Sets the tenant.
    pub fn with_tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = Some(tenant.into());
        self
    }
}

/// A calling application's identity; its prefix keeps the two kinds apart in the scope.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ClientId {
    /// An OAuth `client_id`, scoped as `client:<id>`.
    OAuth(String),
    /// An API key's id (never the secret), scoped as `api-key:<id>`.
    ApiKey(String),
}

/// What to do with a caller that has neither a subject nor a client id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Anonymous {
    /// Scope it by the connection's peer IP address (`peer:<ip>`).
    #[default]
    PeerIp,
    /// Refuse with 500 `IDEMPOTENCY_SCOPE_UNRESOLVED`.
    Refuse,
}

/// Why no scope could be established. Every variant answers 500 `IDEMPOTENCY_SCOPE_UNRESOLVED`:
/// it is a setup mistake of the service, not of the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ScopeError {
    /// The request carries a credential header (`Authorization`, or one configured with
    /// [`credential_headers`](crate::config::ConfigBuilder::credential_headers)) but no
    /// identity was published.
    CredentialWithoutIdentity,
    /// No subject and no client id, and the peer address is unknown.
    NoPeerAddress,
    /// No subject and no client id, and anonymous callers are refused by configuration.
    AnonymousRefused,
    /// The peer is a trusted proxy that gave no usable client address (no forwarded header,
    /// or a hop that is not an address): its own address must not scope every client behind it.
    ProxyWithoutClientAddress,
}

impl ScopeError {
    /// How to fix the setup, for the log line.
    pub fn remedy(self) -> &'static str {
        match self {
            Self::CredentialWithoutIdentity => {
                "the request carries a credential header (Authorization or a configured \
                 credential header) but no Identity was published: authentication must run \
                 before the idempotency step, an outer layer in tower terms (axum: a layer added \
                 after the idempotency layer, so wrapping it, or an extractor before the \
                 handler's last parameter; actix-web: a wrap registered after the idempotency \
                 middleware, or such an extractor) and insert an \
                 idempotent_runtime::scope::Identity into the request extensions; or set a \
                 resolver on the runtime"
            }
            Self::NoPeerAddress => {
                "anonymous request without a peer address: serve with \
                 into_make_service_with_connect_info::<SocketAddr>() (axum) or publish an Identity"
            }
            Self::AnonymousRefused => {
                "anonymous callers are refused by configuration (anonymous = refuse): publish an \
                 Identity for this caller"
            }
            Self::ProxyWithoutClientAddress => {
                "the request came from a trusted proxy without a usable client address: configure \
                 the proxy to send X-Forwarded-For (or Forwarded: for=) with the client's address, \
                 or remove it from trusted_proxies"
            }
        }
    }
}

impl fmt::Display for ScopeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.remedy())
    }
}

impl std::error::Error for ScopeError {}

/// A resolved scope: the three segments and their hash.
#[derive(Clone, PartialEq, Eq)]
pub struct Scope {
    tenant: Option<String>,
    subject: Option<String>,
    client: Option<ClientSegment>,
    hash: ScopeHash,
    quota: u64,
}

/// The client segment: `peer:<IPv4>` kept in place (nearly every anonymous caller, and no
/// allocation for it), any other in a `String`.
#[derive(Clone)]
enum ClientSegment {
    Peer4 { len: u8, text: [u8; PEER4_MAX] },
    Named(String),
}

/// The longest `peer:<IPv4>`.
const PEER4_MAX: usize = "peer:255.255.255.255".len();

impl ClientSegment {
    fn as_str(&self) -> &str {
        match self {
            Self::Peer4 { .. } => std::str::from_utf8(self.as_bytes()).expect("written in ASCII"),
            Self::Named(named) => named,
        }
    }

    /// The segment's bytes, as the hashes read them (no UTF-8 check on the request's path).
    fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Peer4 { len, text } => &text[..usize::from(*len)],
            Self::Named(named) => named.as_bytes(),
        }
    }
}

impl PartialEq for ClientSegment {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for ClientSegment {}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Scope({})", crate::digest::ShortHash(&self.hash))
    }
}

impl Scope {
    /// Builds the scope from an identity, falling back to `peer:<ip>` for segment 7 when there
    /// is neither a subject nor a client id (even when a tenant is known).
    pub fn from_identity(identity: &Identity, peer: Option<IpAddr>) -> Result<Self, ScopeError> {
        let client = match (&identity.client, &identity.subject) {
            (Some(ClientId::OAuth(id)), _) => Some(ClientSegment::Named(format!("client:{id}"))),
            (Some(ClientId::ApiKey(id)), _) => Some(ClientSegment::Named(format!("api-key:{id}"))),
            (None, Some(_)) => None,
            (None, None) => Some(peer_segment(canonical_ip(
                peer.ok_or(ScopeError::NoPeerAddress)?,
            ))),
        };
        Ok(Self::from_segments(
            identity.tenant.clone(),
            identity.subject.clone(),
            client,
            peer.filter(|_| identity.subject.is_none() && identity.client.is_none()),
        ))
    }

    fn from_segments(
        tenant: Option<String>,
        subject: Option<String>,
        client: Option<ClientSegment>,
        anonymous_peer: Option<IpAddr>,
    ) -> Self {
        let mut h = Sha256::new();
        h.update(b"idempotent-scope/v1\n");
        let mut enc = Encoder(&mut h);
        enc.opt_bytes(tenant.as_deref().map(str::as_bytes));
        enc.opt_bytes(subject.as_deref().map(str::as_bytes));
        enc.opt_bytes(client.as_ref().map(ClientSegment::as_bytes));
        let hash: ScopeHash = h.finalize().into();
        let quota = match anonymous_peer.map(canonical_ip) {
            // IPv6 clients get a /64 each; counting per address would let one client mint scopes.
            Some(IpAddr::V6(v6)) => {
                let mut h = Sha256::new();
                h.update(b"idempotent-quota/v1\n");
                Encoder(&mut h).opt_bytes(tenant.as_deref().map(str::as_bytes));
                h.update(&v6.octets()[..8]);
                let d: [u8; 32] = h.finalize().into();
                u64::from_be_bytes(d[..8].try_into().expect("8 bytes"))
            }
            _ => u64::from_be_bytes(hash[..8].try_into().expect("8 bytes")),
        };
        Self {
            tenant,
            subject,
            client,
            hash,
            quota,
        }
    }

    /// The scope hash that leads the store key.
    pub fn hash(&self) -> &ScopeHash {
        &self.hash
    }

    /// The bucket a per-scope record quota counts against (IPv6 peers by /64).
    pub fn quota_bucket(&self) -> u64 {
        self.quota
    }

    /// The tenant segment.
    pub fn tenant(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    /// The subject segment.
    pub fn subject(&self) -> Option<&str> {
        self.subject.as_deref()
    }

    /// The client segment: `client:…`, `api-key:…` or `peer:…`.
    pub fn client(&self) -> Option<&str> {
        self.client.as_ref().map(ClientSegment::as_str)
    }

    pub(crate) fn encode_segments(&self, enc: &mut Encoder<'_>) {
        enc.opt_bytes(self.tenant.as_deref().map(str::as_bytes));
        enc.opt_bytes(self.subject.as_deref().map(str::as_bytes));
        enc.opt_bytes(self.client.as_ref().map(ClientSegment::as_bytes));
    }
}

/// `peer:<ip>`, byte for byte as `format!("peer:{ip}")` writes it. An IPv4 address (nearly
/// every anonymous caller) is written digit by digit in place: through `Display` it cost more
/// than hashing the whole scope, and in a `String` an allocation a request.
fn peer_segment(ip: IpAddr) -> ClientSegment {
    let IpAddr::V4(v4) = ip else {
        return ClientSegment::Named(format!("peer:{ip}"));
    };
    let mut text = [0u8; PEER4_MAX];
    text[..5].copy_from_slice(b"peer:");
    let mut len = 5;
    let mut push = |byte: u8| {
        text[len] = byte;
        len += 1;
    };
    for (i, octet) in v4.octets().into_iter().enumerate() {
        if i > 0 {
            push(b'.');
        }
        if octet >= 100 {
            push(b'0' + octet / 100);
        }
        if octet >= 10 {
            push(b'0' + octet / 10 % 10);
        }
        push(b'0' + octet % 10);
    }
    ClientSegment::Peer4 {
        len: u8::try_from(len).expect("at most 20"),
        text,
    }
}

/// Resolves the scope of a request under the rules of [the contract](crate::design) §4: identity must not silently
/// degrade to the peer address when the request carries credentials.
pub(crate) fn resolve(
    identity: Option<&Identity>,
    carries_credential: bool,
    peer: Option<IpAddr>,
    anonymous: Anonymous,
) -> Result<Scope, ScopeError> {
    let identity = match identity {
        Some(identity) => identity,
        None if carries_credential => return Err(ScopeError::CredentialWithoutIdentity),
        None => &Identity::default(),
    };
    if identity.subject.is_none() && identity.client.is_none() && anonymous == Anonymous::Refuse {
        return Err(ScopeError::AnonymousRefused);
    }
    Scope::from_identity(identity, peer)
}

/// The client's address: the peer, or — when the peer is a trusted proxy — the rightmost
/// forwarded hop that is not itself a trusted proxy, read right to left from `X-Forwarded-For`
/// (or, when the request has no `X-Forwarded-For` line at all, from the `for=` parameters of
/// RFC 7239 `Forwarded`). Forwarded headers from anyone else are ignored, since a client can
/// write whatever it likes there. Addresses are canonical (an IPv4-mapped IPv6 address is its
/// IPv4 address) and a hop's port and brackets are dropped.
///
/// The header values are bytes, as received: a proxy appends its hop to whatever the client
/// sent (nginx's `$proxy_add_x_forwarded_for`), so the client's part may hold anything, a
/// non-UTF-8 byte, garbage, empty elements. Only the hops from the right up to the first
/// address that is not a trusted proxy are read; the bytes before it never matter. Hops are
/// split on every `,` (and `Forwarded` pairs on every `;`) without regard to quotes, so an
/// unbalanced quote the client wrote cannot swallow the element a proxy appended after it.
/// An `X-Forwarded-For` line that yields no hop never hands the decision to `Forwarded`, which
/// the client may have written itself.
///
/// A trusted proxy that gives no usable client address (no header, or a hop such as `unknown`,
/// or a `Forwarded` element without `for=`, before any untrusted address) is
/// [`ScopeError::ProxyWithoutClientAddress`]: its own address would otherwise scope every
/// anonymous client behind it together.
///
/// ```
/// # #[cfg(feature = "testing")] {
/// use idempotent_runtime::scope::ScopeError;
/// use idempotent_runtime::test_helpers::scope::client_ip;
///
/// let proxies = ["10.0.0.0/8".parse().unwrap()];
/// let proxy = "::ffff:10.0.0.1".parse().unwrap();
/// let client = client_ip(proxy, [&b"[2001:db8::7]:4711, 10.0.0.2"[..]], [], &proxies);
/// assert_eq!(client, Ok("2001:db8::7".parse().unwrap()));
/// // Whatever the client wrote before the hop its proxy appended does not count.
/// let spoofed = client_ip(
///     proxy,
///     [&b"6.6.6.6\xff, 198.51.100.9"[..]],
///     [&b"for=192.0.2.7"[..]],
///     &proxies,
/// );
/// assert_eq!(spoofed, Ok("198.51.100.9".parse().unwrap()));
/// let by_rfc7239 = client_ip(proxy, [], [&b"for=192.0.2.60;proto=https"[..]], &proxies);
/// assert_eq!(by_rfc7239, Ok("192.0.2.60".parse().unwrap()));
/// assert_eq!(
///     client_ip(proxy, [], [], &proxies),
///     Err(ScopeError::ProxyWithoutClientAddress)
/// );
/// # }
/// ```
pub(crate) fn client_ip<'a>(
    peer: IpAddr,
    x_forwarded_for: impl IntoIterator<Item = &'a [u8]>,
    forwarded: impl IntoIterator<Item = &'a [u8]>,
    trusted_proxies: &[IpNet],
) -> Result<IpAddr, ScopeError> {
    let peer = canonical_ip(peer);
    let trusted = |ip: &IpAddr| trusted_proxies.iter().any(|net| net.contains(ip));
    if !trusted(&peer) {
        return Ok(peer);
    }
    let mut x_forwarded_for = x_forwarded_for.into_iter().peekable();
    // `None` is a `Forwarded` element without `for=`: a hop, but not an address.
    let hops: Vec<Option<&[u8]>> = if x_forwarded_for.peek().is_some() {
        x_forwarded_for.flat_map(elements).map(Some).collect()
    } else {
        forwarded
            .into_iter()
            .flat_map(elements)
            .map(forwarded_for_param)
            .collect()
    };
    let mut client = None;
    for hop in hops.iter().rev() {
        // A hop that is not an address (`unknown`, an obfuscated name, garbage) ends what can be
        // trusted, and no address before it is the client's.
        let ip = hop
            .and_then(parse_hop)
            .ok_or(ScopeError::ProxyWithoutClientAddress)?;
        client = Some(ip);
        if !trusted(&ip) {
            break;
        }
    }
    client.ok_or(ScopeError::ProxyWithoutClientAddress)
}

/// The non-empty comma-separated elements of one header line, trimmed of ASCII whitespace.
fn elements(line: &[u8]) -> impl Iterator<Item = &[u8]> {
    line.split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|e| !e.is_empty())
}

/// The `for=` value of one `Forwarded` element (`for=192.0.2.60;proto=http`), unquoted.
fn forwarded_for_param(element: &[u8]) -> Option<&[u8]> {
    element.split(|&b| b == b';').find_map(|pair| {
        let eq = pair.iter().position(|&b| b == b'=')?;
        let (name, value) = (&pair[..eq], &pair[eq + 1..]);
        name.trim_ascii()
            .eq_ignore_ascii_case(b"for")
            .then(|| trim_quotes(value.trim_ascii()))
    })
}

fn trim_quotes(mut s: &[u8]) -> &[u8] {
    while let [b'"', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b'"'] = s {
        s = rest;
    }
    s
}

/// One hop as an address: `1.2.3.4`, `1.2.3.4:5678`, `2001:db8::1`, `[2001:db8::1]`,
/// `[2001:db8::1]:443`, canonical. Anything else, non-UTF-8 bytes included, is `None`.
fn parse_hop(hop: &[u8]) -> Option<IpAddr> {
    let hop = std::str::from_utf8(trim_quotes(hop.trim_ascii())).ok()?;
    let ip = if let Some(rest) = hop.strip_prefix('[') {
        let (inside, after) = rest.split_once(']')?;
        if !(after.is_empty() || after.strip_prefix(':').is_some_and(is_port)) {
            return None;
        }
        IpAddr::V6(inside.parse().ok()?)
    } else if let Ok(ip) = hop.parse::<IpAddr>() {
        ip
    } else {
        let (addr, port) = hop.rsplit_once(':')?;
        if !is_port(port) {
            return None;
        }
        IpAddr::V4(addr.parse().ok()?)
    };
    Some(canonical_ip(ip))
}

fn is_port(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && s.parse::<u16>().is_ok()
}

/// The canonical form of an address: an IPv4-mapped IPv6 address (`::ffff:10.0.0.1`) is its
/// IPv4 address, for `trusted_proxies` as for the scope.
pub(crate) fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// What a [resolver](crate::IdempotencyBuilder::resolver) sees of a request: its head, framework-free.
pub struct RequestHead<'a> {
    pub(crate) method: &'a str,
    pub(crate) route: Option<&'a str>,
    pub(crate) peer: Option<IpAddr>,
    pub(crate) headers: &'a dyn HeaderLookup,
}

/// Reads a request's headers for [`RequestHead`].
pub(crate) trait HeaderLookup {
    fn first<'a>(&'a self, name: &'a str) -> Option<&'a [u8]>;
}

impl<'a> RequestHead<'a> {
    /// The method, e.g. `POST`.
    pub fn method(&self) -> &str {
        self.method
    }

    /// The matched route pattern (with any nest or scope prefix); `None` outside a route.
    pub fn route(&self) -> Option<&str> {
        self.route
    }

    /// The connection's peer address (canonical), before any forwarded header.
    pub fn peer(&self) -> Option<IpAddr> {
        self.peer
    }

    /// The first value of a header (any case), as bytes.
    pub fn header<'s>(&'s self, name: &'s str) -> Option<&'s [u8]> {
        self.headers.first(name)
    }

    /// The first value of a header, when it is UTF-8.
    pub fn header_str<'s>(&'s self, name: &'s str) -> Option<&'s str> {
        std::str::from_utf8(self.header(name)?).ok()
    }
}

impl fmt::Debug for RequestHead<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestHead")
            .field("method", &self.method)
            .field("route", &self.route)
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

/// What a resolver says about a caller.
#[derive(Debug, Clone)]
pub enum Resolution {
    /// The caller is this identity.
    Identity(Identity),
    /// The resolver does not know the caller: the usual rules apply (a request carrying a
    /// credential header is refused; otherwise it is anonymous).
    Unknown,
    /// Refuse the request with this problem before anything is claimed (e.g. a 401 for a
    /// credential the resolver rejects).
    Refuse(crate::problem::Problem),
}

/// A function of the request head that establishes the caller's identity, set on the runtime
/// with [`Builder::resolver`](crate::IdempotencyBuilder::resolver). It runs only when the
/// application published no [`Identity`] in the request extensions.
pub(crate) type Resolver = std::sync::Arc<dyn Fn(&RequestHead<'_>) -> Resolution + Send + Sync>;

/// A resolver that waits for its answer (a token introspection, a session or API-key lookup),
/// set with [`Builder::resolver_async`](crate::IdempotencyBuilder::resolver_async): it reads what it
/// needs from the head at once and returns a future that owns it. Like [`Resolver`], it runs
/// only when the application published no [`Identity`], and before anything is claimed.
pub(crate) type AsyncResolver = std::sync::Arc<
    dyn Fn(&RequestHead<'_>) -> futures_util::future::BoxFuture<'static, Resolution> + Send + Sync,
>;

/// The resolver a handle holds: one that answers at once, or one that waits.
#[derive(Clone)]
pub(crate) enum ResolveWith {
    Now(Resolver),
    Later(AsyncResolver),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn tenants_subjects_and_clients_get_distinct_scopes() {
        let a = resolve(
            Some(&Identity::subject("t1", "u")),
            true,
            None,
            Anonymous::PeerIp,
        )
        .unwrap();
        let b = resolve(
            Some(&Identity::subject("t2", "u")),
            true,
            None,
            Anonymous::PeerIp,
        )
        .unwrap();
        let c = resolve(
            Some(&Identity::client(ClientId::OAuth("u".into())).with_tenant("t1")),
            true,
            None,
            Anonymous::PeerIp,
        )
        .unwrap();
        let d = resolve(
            Some(&Identity::client(ClientId::ApiKey("u".into())).with_tenant("t1")),
            true,
            None,
            Anonymous::PeerIp,
        )
        .unwrap();
        let hashes = [a.hash(), b.hash(), c.hash(), d.hash()];
        for (i, x) in hashes.iter().enumerate() {
            for y in &hashes[i + 1..] {
                assert_ne!(x, y);
            }
        }
        assert_eq!(c.client(), Some("client:u"));
        assert_eq!(d.client(), Some("api-key:u"));
    }

    #[test]
    fn segments_are_framed_so_values_cannot_shift() {
        let a = Scope::from_identity(&Identity::subject("ab", "c"), None).unwrap();
        let b = Scope::from_identity(&Identity::subject("a", "bc"), None).unwrap();
        assert_ne!(a.hash(), b.hash());
    }

    #[test]
    fn anonymous_callers_are_scoped_by_peer_ip_without_port() {
        let a = resolve(None, false, peer("127.0.0.2"), Anonymous::PeerIp).unwrap();
        let b = resolve(None, false, peer("127.0.0.3"), Anonymous::PeerIp).unwrap();
        assert_eq!(a.client(), Some("peer:127.0.0.2"));
        assert_ne!(a.hash(), b.hash());
        assert_eq!(a.subject(), None);
    }

    #[test]
    // The digest was computed from the encoding in the module docs by an independent Python
    // rendition; scope hashes lead stored keys, so a change here strands every record.
    fn peer_scope_hash_is_pinned() {
        let scope = resolve(None, false, peer("192.0.2.60"), Anonymous::PeerIp).unwrap();
        let hex: String = scope.hash().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "2b5dbd5130eab59645bdfcc055d138909f2dbb2142f6c5df185291a9118b13a0"
        );
    }

    #[test]
    fn peer_segment_is_written_as_display_writes_it() {
        for octet in [0u8, 1, 9, 10, 42, 99, 100, 101, 199, 200, 255] {
            for ip in [[octet, 0, 0, 1], [10, octet, 255, octet], [octet; 4]] {
                let ip = IpAddr::from(ip);
                assert_eq!(peer_segment(ip).as_str(), format!("peer:{ip}"));
            }
        }
        let v6: IpAddr = "2001:db8::7".parse().unwrap();
        assert_eq!(peer_segment(v6).as_str(), "peer:2001:db8::7");
    }

    proptest::proptest! {
        #[test]
        fn every_ipv4_peer_segment_matches_display(bits: u32) {
            let ip = IpAddr::from(std::net::Ipv4Addr::from(bits));
            let segment = peer_segment(ip);
            proptest::prop_assert_eq!(segment.as_str(), format!("peer:{ip}"));
        }
    }

    #[test]
    fn tenant_only_identity_still_uses_the_peer_in_segment_seven() {
        let id = Identity::default().with_tenant("acme");
        let s = resolve(Some(&id), true, peer("10.0.0.1"), Anonymous::PeerIp).unwrap();
        assert_eq!(s.tenant(), Some("acme"));
        assert_eq!(s.subject(), None);
        assert_eq!(s.client(), Some("peer:10.0.0.1"));
    }

    #[test]
    fn identity_never_silently_degrades() {
        assert_eq!(
            resolve(None, true, peer("127.0.0.1"), Anonymous::PeerIp),
            Err(ScopeError::CredentialWithoutIdentity)
        );
        assert_eq!(
            resolve(None, false, None, Anonymous::PeerIp),
            Err(ScopeError::NoPeerAddress)
        );
        assert_eq!(
            resolve(None, false, peer("127.0.0.1"), Anonymous::Refuse),
            Err(ScopeError::AnonymousRefused)
        );
    }

    #[test]
    fn ipv4_mapped_ipv6_peers_are_the_same_caller() {
        let a = resolve(None, false, peer("::ffff:192.0.2.1"), Anonymous::PeerIp).unwrap();
        let b = resolve(None, false, peer("192.0.2.1"), Anonymous::PeerIp).unwrap();
        assert_eq!(a.hash(), b.hash());
    }

    #[test]
    fn ipv6_peers_share_a_quota_bucket_per_64() {
        let a = resolve(None, false, peer("2001:db8::1"), Anonymous::PeerIp).unwrap();
        let b = resolve(None, false, peer("2001:db8::2"), Anonymous::PeerIp).unwrap();
        let c = resolve(None, false, peer("2001:db8:0:1::1"), Anonymous::PeerIp).unwrap();
        assert_ne!(a.hash(), b.hash());
        assert_eq!(a.quota_bucket(), b.quota_bucket());
        assert_ne!(a.quota_bucket(), c.quota_bucket());
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn via(peer: &str, xff: &[&str], fwd: &[&str]) -> Result<IpAddr, ScopeError> {
        let xff: Vec<&[u8]> = xff.iter().map(|v| v.as_bytes()).collect();
        let fwd: Vec<&[u8]> = fwd.iter().map(|v| v.as_bytes()).collect();
        via_bytes(peer, &xff, &fwd)
    }

    fn via_bytes(peer: &str, xff: &[&[u8]], fwd: &[&[u8]]) -> Result<IpAddr, ScopeError> {
        let proxies: Vec<IpNet> = vec!["10.0.0.0/8".parse().unwrap()];
        client_ip(ip(peer), xff.iter().copied(), fwd.iter().copied(), &proxies)
    }

    #[test]
    fn forwarded_headers_are_trusted_only_from_trusted_proxies() {
        assert_eq!(
            via("198.51.100.1", &["203.0.113.9"], &["for=203.0.113.9"]),
            Ok(ip("198.51.100.1"))
        );
        assert_eq!(
            via("10.1.1.1", &["1.2.3.4, 203.0.113.9, 10.2.2.2"], &[]),
            Ok(ip("203.0.113.9"))
        );
        // Two header lines are one list, in order.
        assert_eq!(
            via("10.1.1.1", &["203.0.113.9", "10.2.2.2"], &[]),
            Ok(ip("203.0.113.9"))
        );
        // Every hop a proxy: the leftmost is the client the first proxy saw.
        assert_eq!(
            via("10.1.1.1", &["10.3.3.3, 10.2.2.2"], &[]),
            Ok(ip("10.3.3.3"))
        );
    }

    #[test]
    fn ipv4_mapped_peers_match_ipv4_proxies() {
        assert_eq!(
            via("::ffff:10.1.1.1", &["203.0.113.9"], &[]),
            Ok(ip("203.0.113.9"))
        );
        assert_eq!(
            via("::ffff:198.51.100.1", &["203.0.113.9"], &[]),
            Ok(ip("198.51.100.1"))
        );
        assert_eq!(
            via("10.1.1.1", &["::ffff:203.0.113.9"], &[]),
            Ok(ip("203.0.113.9"))
        );
    }

    #[test]
    fn hops_with_ports_and_brackets_are_normalised() {
        assert_eq!(via("10.1.1.1", &["1.2.3.4:5678"], &[]), Ok(ip("1.2.3.4")));
        assert_eq!(
            via("10.1.1.1", &["[2001:db8::1]"], &[]),
            Ok(ip("2001:db8::1"))
        );
        assert_eq!(
            via("10.1.1.1", &["[2001:db8::1]:443"], &[]),
            Ok(ip("2001:db8::1"))
        );
        assert_eq!(
            via("10.1.1.1", &["2001:db8::1"], &[]),
            Ok(ip("2001:db8::1"))
        );
        assert_eq!(
            via("10.1.1.1", &["203.0.113.9, 10.0.0.9:80"], &[]),
            Ok(ip("203.0.113.9"))
        );
    }

    #[test]
    fn rfc7239_forwarded_for_is_read_when_there_is_no_x_forwarded_for() {
        assert_eq!(
            via(
                "10.1.1.1",
                &[],
                &[r#"for=192.0.2.43, For="[2001:db8:cafe::17]:4711";proto=https"#]
            ),
            Ok(ip("2001:db8:cafe::17"))
        );
        assert_eq!(
            via("10.1.1.1", &[], &["for=192.0.2.60;proto=http;by=10.0.0.1"]),
            Ok(ip("192.0.2.60"))
        );
        assert_eq!(
            via("10.1.1.1", &[], &["proto=https;by=10.0.0.1"]),
            Err(ScopeError::ProxyWithoutClientAddress)
        );
    }

    #[test]
    fn a_trusted_proxy_without_a_usable_client_address_is_refused() {
        for xff in [
            &[][..],
            &["unknown"],
            &["garbage"],
            &["203.0.113.9, unknown"],
            &[" , "],
        ] {
            assert_eq!(
                via("10.1.1.1", xff, &[]),
                Err(ScopeError::ProxyWithoutClientAddress),
                "{xff:?}"
            );
        }
        assert_eq!(
            via("10.1.1.1", &[], &["for=unknown"]),
            Err(ScopeError::ProxyWithoutClientAddress)
        );
        assert_eq!(
            via("10.1.1.1", &[], &["for=_hidden"]),
            Err(ScopeError::ProxyWithoutClientAddress)
        );
        // An untrusted hop before garbage is still the client.
        assert_eq!(
            via("10.1.1.1", &["garbage, 203.0.113.9"], &[]),
            Ok(ip("203.0.113.9"))
        );
    }

    #[test]
    fn the_proxys_hop_is_found_whatever_bytes_the_client_wrote_before_it() {
        let real = Ok(ip("198.51.100.9"));
        for xff in [
            &b"6.6.6.6\xff, 198.51.100.9"[..],
            b"\xff\xfe\x80, 198.51.100.9",
            b"garbage, 198.51.100.9",
            b"\"unclosed, 198.51.100.9",
            b", , ,198.51.100.9",
            b"192.0.2.7,,\t198.51.100.9 ",
            b"[2001:db8::1, 198.51.100.9",
            b"6.6.6.6\xff, 198.51.100.9, 10.0.0.2",
        ] {
            assert_eq!(
                via_bytes("10.1.1.1", &[xff], &[b"for=192.0.2.7"]),
                real,
                "{}",
                xff.escape_ascii()
            );
        }
        // The proxy may add a line of its own rather than append to the client's.
        assert_eq!(
            via_bytes(
                "10.1.1.1",
                &[b"6.6.6.6\xff", b"198.51.100.9"],
                &[b"for=192.0.2.7"]
            ),
            real
        );
        assert_eq!(
            via_bytes(
                "10.1.1.1",
                &[b"\xff, 203.0.113.1", b"198.51.100.9, 10.0.0.3"],
                &[]
            ),
            real
        );
    }

    #[test]
    fn an_x_forwarded_for_line_without_a_hop_never_defers_to_forwarded() {
        for xff in [&b"\xff"[..], b"", b" ", b",", b" , \t, ", b"\xff\xfe, \x80"] {
            assert_eq!(
                via_bytes("10.1.1.1", &[xff], &[b"for=192.0.2.7"]),
                Err(ScopeError::ProxyWithoutClientAddress),
                "{}",
                xff.escape_ascii()
            );
        }
        assert_eq!(
            via_bytes("10.1.1.1", &[b"\xff", b""], &[b"for=192.0.2.7"]),
            Err(ScopeError::ProxyWithoutClientAddress)
        );
    }

    #[test]
    fn a_trusted_hop_that_is_not_an_address_is_refused() {
        for xff in [
            &b"198.51.100.9, 10.0.0.2\xff"[..],
            b"198.51.100.9, unknown",
            b"198.51.100.9\xff",
            b"198.51.100.9, 10.0.0.2:99999",
            b"198.51.100.9, [10.0.0.2]",
        ] {
            assert_eq!(
                via_bytes("10.1.1.1", &[xff], &[]),
                Err(ScopeError::ProxyWithoutClientAddress),
                "{}",
                xff.escape_ascii()
            );
        }
        // A Forwarded element the proxy appended without `for=` gives no client address, and
        // the client's own element before it does not stand in for one.
        assert_eq!(
            via_bytes(
                "10.1.1.1",
                &[],
                &[b"for=192.0.2.7, proto=https;by=10.0.0.1"]
            ),
            Err(ScopeError::ProxyWithoutClientAddress)
        );
    }

    #[test]
    fn forwarded_is_read_as_bytes_too() {
        let real = Ok(ip("198.51.100.9"));
        for fwd in [
            &b"for=6.6.6.6\xff, for=198.51.100.9"[..],
            b"for=\"unclosed, for=198.51.100.9;proto=https",
            b"\xff;for=1.2.3.4, , FOR=\"198.51.100.9:443\"",
            b"garbage, for=198.51.100.9",
        ] {
            assert_eq!(
                via_bytes("10.1.1.1", &[], &[fwd]),
                real,
                "{}",
                fwd.escape_ascii()
            );
        }
        assert_eq!(
            via_bytes("10.1.1.1", &[], &[b"for=192.0.2.7", b"for=198.51.100.9"]),
            real
        );
        assert_eq!(
            via_bytes("10.1.1.1", &[], &[b"for=198.51.100.9\xff"]),
            Err(ScopeError::ProxyWithoutClientAddress)
        );
    }

    /// What a client controls behind a proxy that appends its hop: the bytes before it, and
    /// every `Forwarded` line.
    mod client_controlled {
        use super::*;
        use proptest::prelude::*;

        fn proxies() -> Vec<IpNet> {
            vec!["10.0.0.0/8".parse().unwrap()]
        }

        fn line(client: &[u8], appended: &[u8]) -> Vec<u8> {
            let mut line = client.to_vec();
            line.extend_from_slice(b", ");
            line.extend_from_slice(appended);
            line
        }

        /// Bytes a client picks, biased towards what a parser might misread.
        fn client_bytes() -> impl Strategy<Value = Vec<u8>> {
            let piece = prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..12),
                Just(b"for=192.0.2.7".to_vec()),
                Just(b"192.0.2.7".to_vec()),
                Just(b"10.0.0.5".to_vec()),
                Just(b"\"".to_vec()),
                Just(b",".to_vec()),
                Just(b";".to_vec()),
                Just(b"[".to_vec()),
                Just(b"\xff".to_vec()),
                Just(b" \t".to_vec()),
            ];
            proptest::collection::vec(piece, 0..8).prop_map(|p| p.concat())
        }

        proptest! {
            #[test]
            fn the_scope_is_the_appended_hop(
                client in client_bytes(),
                forwarded in proptest::collection::vec(client_bytes(), 0..3),
                behind_second_proxy: bool,
            ) {
                let appended: &[u8] = if behind_second_proxy {
                    b"198.51.100.9, 10.0.0.3"
                } else {
                    b"198.51.100.9"
                };
                let xff = line(&client, appended);
                let fwd: Vec<&[u8]> = forwarded.iter().map(Vec::as_slice).collect();
                let got = client_ip(ip("10.1.1.1"), [xff.as_slice()], fwd, &proxies());
                prop_assert_eq!(got, Ok(ip("198.51.100.9")));
            }

            #[test]
            fn an_unreadable_appended_hop_is_refused(
                client in client_bytes(),
                forwarded in proptest::collection::vec(client_bytes(), 0..3),
                appended in prop_oneof![
                    Just(&b"unknown"[..]), Just(&b"\xff"[..]), Just(&b"_hidden"[..]),
                    Just(&b"198.51.100.9, 10.0.0.3\xff"[..]),
                ],
            ) {
                let xff = line(&client, appended);
                let fwd: Vec<&[u8]> = forwarded.iter().map(Vec::as_slice).collect();
                let got = client_ip(ip("10.1.1.1"), [xff.as_slice()], fwd, &proxies());
                prop_assert_eq!(got, Err(ScopeError::ProxyWithoutClientAddress));
            }

            #[test]
            fn the_scope_is_the_appended_forwarded_element(
                client in client_bytes(),
                earlier in proptest::collection::vec(client_bytes(), 0..3),
            ) {
                let fwd = line(&client, b"for=\"[2001:db8::9]:443\";proto=https");
                let mut lines: Vec<&[u8]> = earlier.iter().map(Vec::as_slice).collect();
                lines.push(&fwd);
                let got = client_ip(ip("10.1.1.1"), [], lines, &proxies());
                prop_assert_eq!(got, Ok(ip("2001:db8::9")));
            }

            #[test]
            fn an_x_forwarded_for_line_always_outranks_forwarded(
                xff in proptest::collection::vec(client_bytes(), 1..3),
                forwarded in proptest::collection::vec(client_bytes(), 0..3),
            ) {
                // Whatever X-Forwarded-For holds, the answer is what it alone gives.
                let x: Vec<&[u8]> = xff.iter().map(Vec::as_slice).collect();
                let f: Vec<&[u8]> = forwarded.iter().map(Vec::as_slice).collect();
                let alone = client_ip(ip("10.1.1.1"), x.clone(), [], &proxies());
                let got = client_ip(ip("10.1.1.1"), x, f, &proxies());
                prop_assert_eq!(got, alone);
            }

            #[test]
            fn an_untrusted_peer_is_the_client_whatever_it_sends(
                xff in proptest::collection::vec(client_bytes(), 0..3),
                forwarded in proptest::collection::vec(client_bytes(), 0..3),
            ) {
                let x: Vec<&[u8]> = xff.iter().map(Vec::as_slice).collect();
                let f: Vec<&[u8]> = forwarded.iter().map(Vec::as_slice).collect();
                let got = client_ip(ip("198.51.100.1"), x, f, &proxies());
                prop_assert_eq!(got, Ok(ip("198.51.100.1")));
            }
        }
    }

    /// Where authentication goes has one wording everywhere a user reads it (issue 29 item 4):
    /// it runs *before* the idempotency step, an outer layer in tower terms. "Outside" and
    /// "inside" the idempotency layer were read both ways, and the log once said the opposite
    /// of the README, so the old phrasings are refused here wherever they could come back.
    #[test]
    fn auth_placement_has_one_wording() {
        let crate_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        // Words only, lowercased: comment markers, string continuations, quotes and line breaks
        // must not hide a phrase that wraps across lines.
        let words = |text: &str| {
            text.split(|c: char| !(c.is_alphanumeric() || c == '\'' || c == '-'))
                .filter(|w| !w.is_empty())
                .map(str::to_lowercase)
                .collect::<Vec<_>>()
                .join(" ")
        };
        let read = |path: &std::path::Path| {
            std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        };
        let mut files = vec![
            crate_dir.join("../README.md"),
            crate_dir.join("README.md"),
            crate_dir.join("docs/DESIGN.md"),
        ];
        let mut dirs = vec![crate_dir.join("src")];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    files.push(path);
                }
            }
        }
        let old = [
            ["outside the", "idempotency"],
            ["inside the", "idempotency"],
            ["auth layer", "sits outside"],
            ["authentication outside", "the route"],
        ]
        .map(|[a, b]| format!("{a} {b}"));
        for path in &files {
            let source = read(path);
            // This file's tests name the old phrasings to refuse them; its code is still read.
            let source = match source.split_once("\nmod tests {") {
                Some((code, _)) if path.ends_with("scope.rs") => code.to_owned(),
                _ => source,
            };
            let text = words(&source);
            for phrase in &old {
                assert!(
                    !text.contains(phrase.as_str()),
                    "{} says \"{phrase}\": say that authentication runs before the idempotency \
                     step (an outer layer in tower terms)",
                    path.display()
                );
            }
        }
        let wording = "before the idempotency step";
        for path in [
            "../README.md",
            "README.md",
            "src/lib.rs",
            "src/axum/mod.rs",
            "src/actix/mod.rs",
        ] {
            let text = words(&read(&crate_dir.join(path)));
            assert!(text.contains(wording), "{path} does not say \"{wording}\"");
        }
        let remedy = words(ScopeError::CredentialWithoutIdentity.remedy());
        assert!(remedy.contains(wording), "the log line's remedy: {remedy}");
        assert!(
            remedy.contains("outer layer"),
            "the log line's remedy: {remedy}"
        );
    }
}
