//! [`Idempotency`], the handle applications share with their handlers: a store, the settings,
//! the hooks, the buffer budget and the count of running handlers.

use std::sync::Arc;

use crate::budget::BufferBudget;
use crate::config::Config;
use crate::fingerprint::FingerprintContributor;
use crate::observe::{AuditSink, DiscardAudit};
use crate::pipeline::Watch;
use crate::reservation::{Running, RunningGuard};
use crate::scope::{RequestHead, Resolution, Resolver};
use crate::store::Store;
use crate::store::memory::MemoryStore;

/// Rows (or entries) a sweep deletes per statement.
pub const SWEEP_BATCH: usize = 500;

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
    store: Arc<dyn Store>,
    config: Config,
    audit: Arc<dyn AuditSink>,
    contributor: Option<Arc<dyn FingerprintContributor>>,
    resolver: Option<Resolver>,
    running: Running,
    budget: Arc<BufferBudget>,
    watch: Watch,
    sweeper: Option<tokio::task::JoinHandle<()>>,
    /// The keys enlisted requests of this process hold now, so a duplicate is answered 409
    /// without the database.
    #[cfg(feature = "postgres")]
    enlisted_in_flight: crate::enlisted::InFlight,
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
pub struct Builder {
    store: Arc<dyn Store>,
    config: Config,
    audit: Arc<dyn AuditSink>,
    contributor: Option<Arc<dyn FingerprintContributor>>,
    resolver: Option<Resolver>,
    sweeper: bool,
    max_buffered: usize,
}

impl Builder {
    /// Settings (default [`Config::default`]).
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// Where replayed, in-progress and key-reused decisions are reported (default: discarded).
    pub fn audit(mut self, sink: impl AuditSink) -> Self {
        self.audit = Arc::new(sink);
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
        self.resolver = Some(Arc::new(resolver));
        self
    }

    /// Whether to run the background sweeper (default on, when built inside a Tokio runtime).
    /// Turn it off when another process sweeps the shared store.
    pub fn sweeper(mut self, on: bool) -> Self {
        self.sweeper = on;
        self
    }

    /// Bound on the bytes of request and response bodies buffered at once across all requests
    /// (default 256 MiB). Past it, new requests get 503 `IDEMPOTENCY_STORE_FULL`.
    pub fn max_buffered_bytes(mut self, bytes: usize) -> Self {
        self.max_buffered = bytes;
        self
    }

    /// The handle.
    pub fn build(self) -> Idempotency {
        let sweeper = (self.sweeper && tokio::runtime::Handle::try_current().is_ok()).then(|| {
            crate::store::spawn_sweeper(
                Arc::downgrade(&self.store),
                self.config.retention,
                SWEEP_BATCH,
            )
        });
        let watch = Watch::new(memory_id(&self.store));
        Idempotency {
            inner: Arc::new(Inner {
                store: self.store,
                config: self.config,
                audit: self.audit,
                contributor: self.contributor,
                resolver: self.resolver,
                running: Running::default(),
                budget: BufferBudget::new(self.max_buffered),
                watch,
                sweeper,
                #[cfg(feature = "postgres")]
                enlisted_in_flight: crate::enlisted::InFlight::default(),
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
    pub(crate) fn resolver(&self) -> Option<&Resolver> {
        self.inner.resolver.as_ref()
    }

    /// Counts a claimed handler until the guard drops, so [`Self::shutdown`] waits for it.
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
    pub fn builder(store: impl Store) -> Builder {
        Self::builder_arc(Arc::new(store))
    }

    /// A builder over a store already behind an `Arc` (to keep a typed handle on it too).
    pub fn builder_arc(store: Arc<dyn Store>) -> Builder {
        Builder {
            store,
            config: Config::default(),
            audit: Arc::new(DiscardAudit),
            contributor: None,
            resolver: None,
            sweeper: true,
            max_buffered: 256 << 20,
        }
    }

    /// The settings.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
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
    #[cfg(feature = "postgres")]
    pub(crate) fn enlisted_in_flight(&self) -> &crate::enlisted::InFlight {
        &self.inner.enlisted_in_flight
    }

    pub(crate) fn audit(&self) -> &dyn AuditSink {
        &*self.inner.audit
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

/// The identity of an in-memory store, which protects only the handles that share it.
fn memory_id(store: &Arc<dyn Store>) -> Option<usize> {
    let any: &dyn std::any::Any = &**store;
    any.is::<MemoryStore>()
        .then(|| Arc::as_ptr(store).cast::<()>() as usize)
}
