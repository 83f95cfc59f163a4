//! [`Idempotency`], the handle applications share with their handlers: a store, the settings,
//! the hooks, the buffer budget and the count of running handlers.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::budget::BufferBudget;
use crate::config::Config;
use crate::fingerprint::FingerprintContributor;
use crate::observe::{self, AuditSink};
use crate::problem::{Problem, RefusalRenderer, RenderedRefusal};
use crate::reservation::{Running, RunningGuard};
use crate::scope::{RequestHead, Resolution, ResolveWith, ScopeHash};
use crate::store::memory::MemoryStore;
use crate::store::{Backend, RecordInfo, Store, StoreError};
use crate::watch::Watch;

/// Rows (or entries) a sweep deletes per statement.
pub(crate) const SWEEP_BATCH: usize = 500;

/// The idempotency runtime an application shares with its handlers: a store, the settings, and
/// the hooks. Cheap to clone. Put it in your application state (axum: implement
/// `FromRef<AppState>`; actix: `web::Data`).
///
/// ```
/// use idempotent_runtime::Idempotency;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let idempotency = Idempotency::memory();
/// assert_eq!(idempotency.config().lease().as_secs(), 60);
/// # }
/// ```
#[derive(Clone)]
pub struct Idempotency {
    inner: Arc<Inner>,
}

struct Inner {
    store: Backend,
    config: Config,
    /// `None` for the default sink, which discards every event: the request path then skips
    /// building them (a key's SHA-256 each).
    audit: Option<Arc<dyn AuditSink>>,
    contributor: Option<Arc<dyn FingerprintContributor>>,
    resolver: Option<ResolveWith>,
    renderer: Option<Arc<dyn RefusalRenderer>>,
    running: Running,
    budget: Arc<BufferBudget>,
    watch: Watch,
    sweeper: Option<tokio::task::JoinHandle<()>>,
    /// Duplicates waiting for a running request (`wait_in_progress`), woken when a request of
    /// this process settles; nobody is notified while nobody waits.
    settled: Settled,
    /// The keys enlisted requests of this process hold now, so a duplicate is answered 409
    /// without the database.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    enlisted_in_flight: crate::enlisted::HeldKeys,
}

/// See `Inner::settled`.
#[derive(Default)]
struct Settled {
    waiting: AtomicUsize,
    notify: tokio::sync::Notify,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(sweeper) = &self.sweeper {
            sweeper.abort();
        }
    }
}

impl std::fmt::Debug for Idempotency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("config", &self.inner.config)
            .field("running", &self.running())
            .finish_non_exhaustive()
    }
}

/// Builds an [`Idempotency`].
#[must_use]
pub struct IdempotencyBuilder {
    store: Backend,
    config: Config,
    audit: Option<Arc<dyn AuditSink>>,
    contributor: Option<Arc<dyn FingerprintContributor>>,
    resolver: Option<ResolveWith>,
    renderer: Option<Arc<dyn RefusalRenderer>>,
    sweeper: Option<bool>,
    max_buffered: Option<usize>,
}

impl IdempotencyBuilder {
    /// Settings (default [`Config::default`]).
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// Where every decision on a keyed request is reported, executions included (default:
    /// discarded).
    pub fn audit(mut self, sink: impl AuditSink) -> Self {
        self.audit = Some(Arc::new(sink));
        self
    }

    /// A hook that changes what the fingerprint covers.
    pub fn fingerprint_contributor(mut self, contributor: impl FingerprintContributor) -> Self {
        self.contributor = Some(Arc::new(contributor));
        self
    }

    /// A function of the request head that establishes the caller's identity where the
    /// application published none in the request extensions (saving it a middleware): an
    /// identity, [`Resolution::Unknown`] for the usual rules, or a refusal answered before
    /// anything is claimed.
    ///
    /// ```
    /// use idempotent_runtime::Idempotency;
    /// use idempotent_runtime::scope::{ClientId, Identity, Resolution};
    /// use idempotent_runtime::store::memory::MemoryStore;
    ///
    /// let idempotency = Idempotency::builder(MemoryStore::default())
    ///     .resolver(|head| match head.header_str("x-api-key") {
    ///         Some(id) => Resolution::Identity(Identity::client(ClientId::ApiKey(id.into()))),
    ///         None => Resolution::Unknown,
    ///     })
    ///     .sweeper(false)
    ///     .build();
    /// # drop(idempotency);
    /// ```
    pub fn resolver(
        mut self,
        resolver: impl Fn(&RequestHead<'_>) -> Resolution + Send + Sync + 'static,
    ) -> Self {
        self.resolver = Some(ResolveWith::Now(Arc::new(resolver)));
        self
    }

    /// As [`resolver`](Self::resolver), for a resolver that has to wait for its answer (a
    /// token introspection endpoint, a session store, an API-key table): it reads what it needs
    /// from the head at once and returns a future that owns it, awaited before anything is
    /// claimed. Replaces a resolver set before.
    ///
    /// ```
    /// use idempotent_runtime::Idempotency;
    /// use idempotent_runtime::scope::{ClientId, Identity, Resolution};
    /// use idempotent_runtime::store::memory::MemoryStore;
    ///
    /// # async fn lookup(key: &str) -> Option<String> { Some(key.to_owned()) }
    /// let idempotency = Idempotency::builder(MemoryStore::default())
    ///     .resolver_async(|head| {
    ///         let key = head.header_str("x-api-key").map(str::to_owned);
    ///         async move {
    ///             let Some(key) = key else { return Resolution::Unknown };
    ///             match lookup(&key).await {
    ///                 Some(client) => Resolution::Identity(Identity::client(ClientId::ApiKey(client))),
    ///                 None => Resolution::Unknown,
    ///             }
    ///         }
    ///     })
    ///     .sweeper(false)
    ///     .build();
    /// # drop(idempotency);
    /// ```
    pub fn resolver_async<F, Fut>(mut self, resolver: F) -> Self
    where
        F: Fn(&RequestHead<'_>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Resolution> + Send + 'static,
    {
        self.resolver = Some(ResolveWith::Later(Arc::new(move |head| {
            Box::pin(resolver(head))
        })));
        self
    }

    /// Renders refusals (409, 422, 400, 413, 503, …) in the application's own format instead of
    /// `application/problem+json` (the default). The status and `Retry-After` are kept.
    pub fn refusal_renderer(mut self, renderer: impl RefusalRenderer) -> Self {
        self.renderer = Some(Arc::new(renderer));
        self
    }

    /// Whether to run the background sweeper (default [`Config::sweeper`], on, when built
    /// inside a Tokio runtime). Turn it off when another process sweeps the shared store.
    pub fn sweeper(mut self, on: bool) -> Self {
        self.sweeper = Some(on);
        self
    }

    /// Bound on the bytes of request and response bodies buffered at once across all requests
    /// (default [`Config::max_buffered_bytes`], 256 MiB). Past it, new requests get 503
    /// `IDEMPOTENCY_STORE_FULL`.
    pub fn max_buffered_bytes(mut self, bytes: usize) -> Self {
        self.max_buffered = Some(bytes);
        self
    }

    /// The handle.
    pub fn build(self) -> Idempotency {
        let sweeper = self.sweeper.unwrap_or(self.config.sweeper);
        let max_buffered = self.max_buffered.unwrap_or(self.config.max_buffered_bytes);
        let sweeper = (sweeper && tokio::runtime::Handle::try_current().is_ok()).then(|| {
            crate::store::sweeper(self.store.downgrade(), self.config.retention, SWEEP_BATCH)
        });
        let local = self.store.process_local();
        let store = self.store.kind();
        if local.is_some() {
            // Said at startup: nothing fails when replicas each keep their own records, so
            // nothing would say it later.
            tracing::info!(
                store,
                "idempotency on the in-memory store: it protects this process only; a retry \
                 that reaches another replica or a restarted process runs again (use the \
                 PostgreSQL or Redis store for more than one process)"
            );
        } else {
            tracing::info!(store, "idempotency on the {store} store");
        }
        let watch = Watch::new(local.map(|local| local.id()));
        Idempotency {
            inner: Arc::new(Inner {
                store: self.store,
                config: self.config,
                audit: self.audit,
                contributor: self.contributor,
                resolver: self.resolver,
                renderer: self.renderer,
                running: Running::default(),
                budget: BufferBudget::new(max_buffered),
                watch,
                sweeper,
                settled: Settled::default(),
                #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
                enlisted_in_flight: crate::enlisted::HeldKeys::default(),
            }),
        }
    }
}

impl Idempotency {
    /// The fingerprint hook.
    pub(crate) fn contributor(&self) -> Option<&dyn FingerprintContributor> {
        self.inner.contributor.as_deref()
    }

    /// The identity resolver, if one is set.
    pub(crate) fn resolver(&self) -> Option<&ResolveWith> {
        self.inner.resolver.as_ref()
    }

    /// Counts a claimed handler until the guard drops, so [`Self::shutdown`] waits for it.
    /// Waits until a request of this process settles (its key recorded or released), or
    /// `until`, whichever comes first.
    pub(crate) async fn settled_or(&self, until: tokio::time::Instant) {
        let settled = &self.inner.settled;
        settled.waiting.fetch_add(1, Ordering::SeqCst);
        let notified = settled.notify.notified();
        let _ = tokio::time::timeout_at(until, notified).await;
        settled.waiting.fetch_sub(1, Ordering::SeqCst);
    }

    /// Wakes the duplicates waiting in [`settled_or`](Self::settled_or), if any.
    pub(crate) fn wake_waiting(&self) {
        let settled = &self.inner.settled;
        if settled.waiting.load(Ordering::SeqCst) > 0 {
            settled.notify.notify_waiters();
        }
    }

    pub(crate) fn enter_running(&self) -> RunningGuard {
        self.inner.running.enter()
    }

    /// The embedded default: an in-memory store with default limits and settings.
    pub fn memory() -> Self {
        Self::new(MemoryStore::default())
    }

    /// A handle over `store` with default settings.
    pub fn new(store: impl Store) -> Self {
        Self::builder(store).build()
    }

    /// A builder over `store`.
    pub fn builder(store: impl Store) -> IdempotencyBuilder {
        Self::builder_arc(Arc::new(store))
    }

    /// A builder over a store already behind an `Arc` (to keep a typed handle on it too).
    pub fn builder_arc<S: Store>(store: Arc<S>) -> IdempotencyBuilder {
        IdempotencyBuilder {
            store: store.into_backend(),
            config: Config::default(),
            audit: None,
            contributor: None,
            resolver: None,
            renderer: None,
            sweeper: None,
            max_buffered: None,
        }
    }

    /// The settings.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The store.
    pub(crate) fn store(&self) -> &Backend {
        &self.inner.store
    }

    /// Claimed handlers running now.
    pub fn running(&self) -> usize {
        self.inner.running.count()
    }

    /// Bytes of request and response bodies buffered now, across all requests.
    pub fn buffered_bytes(&self) -> usize {
        self.inner.budget.used()
    }

    #[cfg_attr(not(any(feature = "axum", feature = "actix")), allow(dead_code))]
    pub(crate) fn budget(&self) -> &Arc<BufferBudget> {
        &self.inner.budget
    }

    pub(crate) fn watch(&self) -> &Watch {
        &self.inner.watch
    }

    /// The keys this process's enlisted requests hold now.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    pub(crate) fn enlisted_in_flight(&self) -> &crate::enlisted::HeldKeys {
        &self.inner.enlisted_in_flight
    }

    /// The application's audit sink; `None` when it set none (the default discards).
    pub(crate) fn audit(&self) -> Option<&dyn AuditSink> {
        self.inner.audit.as_deref()
    }

    /// The body of a refusal: the application's [renderer](IdempotencyBuilder::refusal_renderer), or
    /// `application/problem+json`.
    pub fn render_refusal(&self, problem: &Problem) -> RenderedRefusal {
        match &self.inner.renderer {
            Some(renderer) => renderer.render(problem),
            None => RenderedRefusal::problem_json(problem),
        }
    }

    /// Reads the record of `key` in the scope `scope` for an operator ([the contract](crate::design)
    /// §5 "Admin"): state, status, times, sizes and route, and the recorded response only when
    /// `with_response`. With `route`, a record claimed on another route reads as none (records
    /// written before routes were kept match any). Get the scope hash of the identity the
    /// application publishes with [`Scope::from_identity`](crate::scope::Scope::from_identity).
    ///
    /// ```
    /// use idempotent_runtime::Idempotency;
    /// use idempotent_runtime::scope::{Identity, Scope};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let idempotency = Idempotency::memory();
    /// let scope = Scope::from_identity(&Identity::subject("acme", "alice"), None).unwrap();
    /// let record = idempotency.inspect(scope.hash(), None, "order-17", false).await.unwrap();
    /// assert!(record.is_none(), "key order-17 never ran for acme/alice");
    /// # }
    /// ```
    pub async fn inspect(
        &self,
        scope: &ScopeHash,
        route: Option<&str>,
        key: &str,
        with_response: bool,
    ) -> Result<Option<RecordInfo>, StoreError> {
        let store = self.store();
        let info = observe::timed(
            "inspect",
            store.kind(),
            store.inspect(scope, key, with_response),
        )
        .await?;
        Ok(info.filter(|info| on_route(info, route)))
    }

    /// Deletes the record of `key` in the scope `scope`, whatever its state (a token-free
    /// delete, for clearing a stuck key); with `route`, only a record claimed on that route.
    /// `Ok(false)` when there was none. A handler still running under a forgotten reservation
    /// cannot record its response; the key's next request runs the handler again.
    pub async fn forget(
        &self,
        scope: &ScopeHash,
        route: Option<&str>,
        key: &str,
    ) -> Result<bool, StoreError> {
        if route.is_some() && self.inspect(scope, route, key, false).await?.is_none() {
            return Ok(false);
        }
        let store = self.store();
        let forgotten = observe::timed("forget", store.kind(), store.forget(scope, key)).await?;
        if forgotten {
            tracing::info!(
                scope = %observe::ShortHash(scope),
                key_hash = %observe::KeyDisplay(key),
                "idempotency record forgotten by an operator"
            );
        }
        Ok(forgotten)
    }

    /// Sets the gauges of [the contract](crate::design) §7 from their current values
    /// (`idempotent_running_reservations`, `idempotent_buffered_bytes`, and for a store that
    /// reports [gauges](Store::gauges), the in-memory one or a wrapper around it,
    /// `idempotent_memory_store_records` and `idempotent_memory_store_bytes`). Call it
    /// before each scrape, or on a timer. A no-op without the `metrics` feature.
    pub fn report_gauges(&self) {
        #[cfg(feature = "metrics")]
        {
            metrics::gauge!("idempotent_running_reservations").set(self.running() as f64);
            metrics::gauge!("idempotent_buffered_bytes").set(self.buffered_bytes() as f64);
            if let Some(gauges) = self.store().gauges() {
                metrics::gauge!("idempotent_memory_store_records").set(gauges.records as f64);
                metrics::gauge!("idempotent_memory_store_bytes").set(gauges.bytes as f64);
            }
        }
    }

    /// Waits until every claimed handler has finished, at most `shutdown_grace`. Call it after
    /// the server stopped accepting requests. Returns `false` if handlers were still running.
    pub async fn shutdown(&self) -> bool {
        let grace = self.inner.config.shutdown_grace;
        tokio::time::timeout(grace, self.inner.running.idle())
            .await
            .is_ok()
    }
}

/// Whether a record belongs to `route` (a record without a known route matches any).
fn on_route(info: &RecordInfo, route: Option<&str>) -> bool {
    match (route, info.route.as_deref()) {
        (Some(wanted), Some(actual)) => wanted == actual,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::Idempotency;
    use crate::scope::ScopeHash;
    use crate::store::memory::MemoryStore;
    use crate::store::{
        Claim, ClaimRequest, Enlisting, FencingToken, ProcessLocal, RecordInfo, RecordedResponse,
        Store, StoreError, StoreGauges,
    };

    #[test]
    fn building_the_handle_names_its_store_and_the_memory_store_says_it_protects_one_process() {
        let (logs, _guard) = crate::testlog::Logs::capture();
        let _memory = Idempotency::builder(MemoryStore::default())
            .sweeper(false)
            .build();
        let text = logs.text();
        let line = text
            .lines()
            .find(|l| l.contains("INFO"))
            .unwrap_or_default();
        assert!(line.contains("store=\"memory\""), "{text}");
        assert!(line.contains("protects this process only"), "{text}");
    }

    /// A user's wrapper: every method and capability forwarded to the store it wraps.
    struct Wrapped<S>(S);

    impl<S: Store> Store for Wrapped<S> {
        async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
            self.0.claim(req).await
        }
        async fn reclaim(
            &self,
            req: &ClaimRequest<'_>,
            stale: FencingToken,
        ) -> Result<Claim, StoreError> {
            self.0.reclaim(req, stale).await
        }
        async fn complete(
            &self,
            scope: &ScopeHash,
            key: &str,
            token: FencingToken,
            response: &RecordedResponse,
            retention: Duration,
        ) -> Result<bool, StoreError> {
            self.0
                .complete(scope, key, token, response, retention)
                .await
        }
        async fn release(
            &self,
            scope: &ScopeHash,
            key: &str,
            token: FencingToken,
        ) -> Result<bool, StoreError> {
            self.0.release(scope, key, token).await
        }
        async fn renew(
            &self,
            scope: &ScopeHash,
            key: &str,
            token: FencingToken,
            lease: Duration,
        ) -> Result<bool, StoreError> {
            self.0.renew(scope, key, token, lease).await
        }
        async fn sweep(&self, batch: usize) -> Result<usize, StoreError> {
            self.0.sweep(batch).await
        }
        async fn inspect(
            &self,
            scope: &ScopeHash,
            key: &str,
            with_response: bool,
        ) -> Result<Option<RecordInfo>, StoreError> {
            self.0.inspect(scope, key, with_response).await
        }
        async fn forget(&self, scope: &ScopeHash, key: &str) -> Result<bool, StoreError> {
            self.0.forget(scope, key).await
        }
        fn kind(&self) -> &'static str {
            self.0.kind()
        }
        fn enlisting(&self) -> Option<Enlisting<'_>> {
            self.0.enlisting()
        }
        fn gauges(&self) -> Option<StoreGauges> {
            self.0.gauges()
        }
        fn process_local(&self) -> Option<ProcessLocal> {
            self.0.process_local()
        }
    }

    /// The gauges a handle reports, by name.
    #[cfg(feature = "metrics")]
    #[derive(Default)]
    struct Gauges(std::sync::Mutex<Vec<(String, Arc<std::sync::atomic::AtomicU64>)>>);

    #[cfg(feature = "metrics")]
    impl Gauges {
        fn get(&self, name: &str) -> Option<f64> {
            let gauges = self.0.lock().expect("gauges");
            let (_, value) = gauges.iter().find(|(n, _)| n == name)?;
            Some(f64::from_bits(
                value.load(std::sync::atomic::Ordering::Relaxed),
            ))
        }
    }

    #[cfg(feature = "metrics")]
    impl metrics::Recorder for Gauges {
        fn describe_counter(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn describe_gauge(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn describe_histogram(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn register_counter(
            &self,
            _: &metrics::Key,
            _: &metrics::Metadata<'_>,
        ) -> metrics::Counter {
            metrics::Counter::noop()
        }
        fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
            let value = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let mut gauges = self.0.lock().expect("gauges");
            gauges.push((key.name().to_owned(), Arc::clone(&value)));
            metrics::Gauge::from_arc(value)
        }
        fn register_histogram(
            &self,
            _: &metrics::Key,
            _: &metrics::Metadata<'_>,
        ) -> metrics::Histogram {
            metrics::Histogram::noop()
        }
    }

    #[cfg(feature = "metrics")]
    #[tokio::test]
    async fn a_wrapper_around_the_memory_store_reports_its_gauges() {
        let store = Arc::new(Wrapped(MemoryStore::default()));
        let handle = Idempotency::builder_arc(Arc::clone(&store))
            .sweeper(false)
            .build();
        let scope = [4; 32];
        let req = crate::reservation::tests::request(&scope, "k", Duration::from_secs(60));
        assert_eq!(store.claim(&req).await.unwrap(), Claim::Acquired);
        let answer = RecordedResponse::new(201, vec![], bytes::Bytes::from_static(b"done"));
        let retention = Duration::from_secs(60);
        assert!(
            store
                .complete(&scope, "k", req.token, &answer, retention)
                .await
                .unwrap()
        );

        let gauges = Gauges::default();
        metrics::with_local_recorder(&gauges, || handle.report_gauges());
        assert_eq!(gauges.get("idempotent_memory_store_records"), Some(1.0));
        assert_eq!(
            gauges.get("idempotent_memory_store_bytes"),
            Some(store.0.bytes() as f64)
        );
        assert!(store.0.bytes() > 0);
    }

    /// The misuse watch's error line for one route served by two process-local stores.
    const SPLIT: &str = "two different in-memory idempotency stores serve this route";

    #[test]
    fn a_wrapper_around_the_memory_store_is_seen_as_process_local() {
        let (logs, _guard) = crate::testlog::Logs::capture();
        let shared = Arc::new(Wrapped(MemoryStore::default()));
        let first = Idempotency::builder_arc(Arc::clone(&shared))
            .sweeper(false)
            .build();
        let clone = Idempotency::builder_arc(shared).sweeper(false).build();
        first.watch().served("/wrapped-local");
        clone.watch().served("/wrapped-local");
        assert!(
            logs.errors().is_empty(),
            "one store under two handles is fine: {:?}",
            logs.errors()
        );

        let other = Idempotency::builder(Wrapped(MemoryStore::default()))
            .sweeper(false)
            .build();
        other.watch().served("/wrapped-local");
        let errors = logs.errors();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains(SPLIT), "{errors:?}");
    }
}
