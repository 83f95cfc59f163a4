//! OpenAPI for idempotent operations, for [utoipa] 5 documents (feature `utoipa`).
//!
//! An operation behind `#[idempotent]` or the layer takes one more request header and can answer
//! with refusals its handler never returns. [`IdempotentOperation`] adds both to an OpenAPI
//! operation, from the same settings the runtime answers with:
//!
//! - the `Idempotency-Key` header parameter (required or optional, its syntax described; the
//!   name follows a configured [`key_header`](crate::config::ConfigBuilder::key_header));
//! - the `Idempotency-Replayed` header on the responses the handler declared that can be
//!   replayed;
//! - the refusals, as `application/problem+json` with a `$ref` to the [`ProblemDetails`] schema
//!   and an example per `code`: 400 `IDEMPOTENCY_KEY_INVALID` / `IDEMPOTENCY_BODY_INVALID`
//!   (and `IDEMPOTENCY_KEY_REQUIRED`, or 428), 409 `IDEMPOTENCY_IN_PROGRESS` with `Retry-After`,
//!   422 `IDEMPOTENCY_KEY_REUSED` (or 409), 413, 408, 500 `IDEMPOTENCY_SCOPE_UNRESOLVED` /
//!   `IDEMPOTENCY_HANDLER_PANICKED`, 503 `IDEMPOTENCY_STORE_UNAVAILABLE` /
//!   `IDEMPOTENCY_STORE_FULL` with `Retry-After`.
//!
//! [`IdempotentPaths`] applies it to a whole document, as a [`utoipa::Modify`]: every POST and
//! PATCH operation (the methods the attribute and the layer apply to), or the ones listed.
//!
//! ```
//! use idempotent_runtime::openapi::{IdempotentOperation, IdempotentPaths};
//! use utoipa::Modify;
//! use utoipa::openapi::path::{HttpMethod, OperationBuilder, PathItem};
//! use utoipa::openapi::{InfoBuilder, OpenApiBuilder, PathsBuilder, ResponseBuilder};
//!
//! // A document as `#[derive(OpenApi)]` or utoipa-axum's `OpenApiRouter` would produce it.
//! let create_order = OperationBuilder::new()
//!     .operation_id(Some("create_order"))
//!     .response("201", ResponseBuilder::new().description("Order created"))
//!     .build();
//! let mut doc = OpenApiBuilder::new()
//!     .info(InfoBuilder::new().title("shop").version("1").build())
//!     .paths(PathsBuilder::new().path("/orders", PathItem::new(HttpMethod::Post, create_order)))
//!     .build();
//!
//! // `#[idempotent(require_key)]` on create_order:
//! IdempotentPaths::new(IdempotentOperation::new().require_key(true)).modify(&mut doc);
//!
//! let json = serde_json::to_value(&doc).unwrap();
//! let post = &json["paths"]["/orders"]["post"];
//! assert_eq!(post["parameters"][0]["name"], "Idempotency-Key");
//! assert_eq!(post["parameters"][0]["required"], true);
//! assert_eq!(
//!     post["responses"]["409"]["content"]["application/problem+json"]["schema"]["$ref"],
//!     "#/components/schemas/IdempotencyProblemDetails"
//! );
//! assert!(post["responses"]["201"]["headers"]["Idempotency-Replayed"].is_object());
//! ```
//!
//! With utoipa's derive, name it among the document's modifiers (`#[utoipa::path]` may go above
//! or below `#[idempotent]`):
//!
//! ```
//! use idempotent_runtime::config::Config;
//! use idempotent_runtime::openapi::{IdempotentOperation, IdempotentPaths, ProblemDetails};
//! use utoipa::OpenApi;
//! use utoipa::openapi::path::HttpMethod;
//!
//! #[utoipa::path(post, path = "/orders", responses((status = 201, description = "Order created")))]
//! async fn create_order() { /* an `#[idempotent(require_key)]` handler */ }
//!
//! struct Idempotent;
//!
//! impl utoipa::Modify for Idempotent {
//!     fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
//!         let config = Config::default(); // the service's own
//!         IdempotentPaths::new(IdempotentOperation::from_config(&config).require_key(true))
//!             .only("/orders", HttpMethod::Post)
//!             .modify(doc);
//!     }
//! }
//!
//! #[derive(OpenApi)]
//! #[openapi(paths(create_order), components(schemas(ProblemDetails)), modifiers(&Idempotent))]
//! struct ApiDoc;
//!
//! let doc = serde_json::to_value(ApiDoc::openapi()).unwrap();
//! assert_eq!(doc["paths"]["/orders"]["post"]["parameters"][0]["name"], "Idempotency-Key");
//! ```
//!
//! A service that renders refusals in its own format
//! ([`refusal_renderer`](crate::IdempotencyBuilder::refusal_renderer)) documents its own envelope:
//! the schema here describes the crate's `application/problem+json`.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use utoipa::openapi::content::{Content, ContentBuilder};
use utoipa::openapi::example::ExampleBuilder;
use utoipa::openapi::header::{Header, HeaderBuilder};
use utoipa::openapi::path::{
    HttpMethod, Operation, Parameter, ParameterBuilder, ParameterIn, PathItem,
};
use utoipa::openapi::response::{Response, ResponseBuilder};
use utoipa::openapi::schema::{
    KnownFormat, ObjectBuilder, OneOfBuilder, Schema, SchemaFormat, Type,
};
use utoipa::openapi::{Components, OpenApi, Ref, RefOr, Required};

use crate::config::{Config, Effective, EndpointConfig, MissingKeyStatus, ReuseStatus};
use crate::pipeline::REPLAYED_HEADER;
use crate::problem::{self, Problem, ProblemCode};

/// The component name [`ProblemDetails`] is registered under in `#/components/schemas`.
///
/// Not `ProblemDetails`: services often have a schema of that name for their own errors, with
/// their own `code`s, and one would silently replace the other.
pub(crate) const PROBLEM_SCHEMA: &str = "IdempotencyProblemDetails";

/// The schema of a refusal's `application/problem+json` body (RFC 9457): `type`, `title`,
/// `status`, `detail` and the stable `code`, an enum of every [`ProblemCode`].
///
/// A [`utoipa::ToSchema`] type, named `IdempotencyProblemDetails`: register it with
/// `#[openapi(components(schemas(ProblemDetails)))]` or [`register`], and name it in your own
/// responses with `body = ProblemDetails`. It only names the schema; refusals are built by the
/// runtime.
///
/// ```
/// use idempotent_runtime::openapi::ProblemDetails;
/// use idempotent_runtime::problem::ProblemCode;
/// use utoipa::PartialSchema;
///
/// let schema = serde_json::to_value(ProblemDetails::schema()).unwrap();
/// let codes = schema["properties"]["code"]["enum"].as_array().unwrap();
/// assert!(codes.contains(&ProblemCode::InProgress.as_str().into()));
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ProblemDetails;

impl utoipa::PartialSchema for ProblemDetails {
    fn schema() -> RefOr<Schema> {
        let string = || ObjectBuilder::new().schema_type(Type::String);
        ObjectBuilder::new()
            .schema_type(Type::Object)
            .title(Some("Idempotency refusal"))
            .description(Some(
                "An RFC 9457 problem answered by the idempotency layer before or instead of the \
                 operation; `code` is stable, the texts are not.",
            ))
            .property(
                "type",
                string()
                    // `KnownFormat::Uri` needs utoipa's `url` feature, for this one word.
                    .format(Some(SchemaFormat::Custom("uri".to_owned())))
                    .description(Some("Where this code is documented.")),
            )
            .required("type")
            .property(
                "title",
                string().description(Some("A short summary of the code.")),
            )
            .required("title")
            .property(
                "status",
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int32)))
                    .minimum(Some(400))
                    .maximum(Some(599))
                    .description(Some("The response's HTTP status.")),
            )
            .required("status")
            .property(
                "detail",
                string().description(Some("What went wrong with this request.")),
            )
            .required("detail")
            .property(
                "code",
                string()
                    .enum_values(Some(ProblemCode::ALL.iter().map(|code| code.as_str())))
                    .description(Some(
                        "The stable machine-readable reason: branch on this, not on the texts.",
                    )),
            )
            .required("code")
            .examples([example_body(409, ProblemCode::InProgress)])
            .into()
    }
}

impl utoipa::ToSchema for ProblemDetails {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed(PROBLEM_SCHEMA)
    }
}

/// Adds the [`ProblemDetails`] schema to `doc`'s components, which the refusals
/// [`IdempotentOperation::apply`] adds refer to. [`IdempotentPaths`] calls it; call it yourself
/// after applying [`IdempotentOperation`] to operations one by one. Calling it again changes
/// nothing.
pub fn register(doc: &mut OpenApi) {
    let components = doc.components.get_or_insert_with(Components::new);
    components
        .schemas
        .entry(PROBLEM_SCHEMA.to_owned())
        .or_insert_with(<ProblemDetails as utoipa::PartialSchema>::schema);
}

/// What an idempotent operation adds to its OpenAPI description: the key header, the replay
/// marker and the refusals, for one endpoint's settings.
///
/// Start from [`new`](Self::new) (the defaults) or [`from_config`](Self::from_config) (the
/// service's [`Config`]: key header, statuses, recorded statuses), then say what the endpoint's
/// attribute says: [`require_key`](Self::require_key), or [`endpoint`](Self::endpoint) with the
/// [`EndpointConfig`] a layer is given.
///
/// ```
/// use idempotent_runtime::config::{Config, MissingKeyStatus, ReuseStatus};
/// use idempotent_runtime::openapi::IdempotentOperation;
/// use utoipa::openapi::path::Operation;
///
/// let config = Config::builder()
///     .key_header("X-Request-Key")
///     .missing_key_status(MissingKeyStatus::PreconditionRequired)
///     .build();
/// let docs = IdempotentOperation::from_config(&config)
///     .require_key(true)
///     .reuse_status(ReuseStatus::Conflict);
///
/// let mut operation = Operation::new();
/// docs.apply(&mut operation);
/// let json = serde_json::to_value(&operation).unwrap();
/// assert_eq!(json["parameters"][0]["name"], "X-Request-Key");
/// assert!(json["responses"]["428"].is_object()); // the missing key
/// assert!(json["responses"]["422"].is_null()); // a reused key is 409 here
/// ```
#[derive(Debug, Clone)]
pub struct IdempotentOperation {
    config: Config,
    endpoint: EndpointConfig,
    key_header: String,
    enlisted: bool,
}

impl Default for IdempotentOperation {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotentOperation {
    /// An operation with the default settings: the key optional, `Idempotency-Key`, a reused key
    /// 422, a missing one 400.
    pub fn new() -> Self {
        Self::from_config(&Config::default())
    }

    /// An operation served with `config`: its key header, its statuses for a reused and a
    /// missing key, its body cap, and which statuses are recorded (and so may come back
    /// marked `Idempotency-Replayed`).
    pub fn from_config(config: &Config) -> Self {
        Self {
            config: config.clone(),
            endpoint: EndpointConfig::OPTIONAL,
            key_header: display_header_name(config.key_header()),
            enlisted: false,
        }
    }

    /// The endpoint's overrides, as the layer or middleware is given them: whether the key is
    /// required, the status for a reused key, the body cap, the recorded statuses, and where
    /// the key comes from (an endpoint reading it from a header of its own documents that
    /// header; one reading it from the body documents no key header).
    pub fn endpoint(mut self, endpoint: EndpointConfig) -> Self {
        if let Some(source) = endpoint.key_source() {
            self.key_header = source
                .header_name()
                .map(display_header_name)
                .unwrap_or_default();
        }
        self.endpoint = endpoint;
        self
    }

    /// `#[idempotent(require_key)]`: the header is a required parameter and a request without
    /// it is refused (400, or 428, `IDEMPOTENCY_KEY_REQUIRED`).
    pub fn require_key(mut self, required: bool) -> Self {
        self.endpoint.require_key = required;
        self
    }

    /// The status for a key reused with a different request (422 by default, or 409).
    pub fn reuse_status(mut self, status: ReuseStatus) -> Self {
        self.endpoint.reuse_status = Some(status);
        self
    }

    /// The status for a missing required key (400 by default, or 428).
    pub fn missing_key_status(mut self, status: MissingKeyStatus) -> Self {
        self.config.missing_key_status = status;
        self
    }

    /// The header's name as the document shows it (HTTP compares names case-insensitively).
    /// By default the configured key header, each word capitalized: `Idempotency-Key`.
    pub fn key_header(mut self, name: impl Into<String>) -> Self {
        self.key_header = name.into();
        self
    }

    /// `#[idempotent(enlisted)]`: adds the 500 refusals of enlisted mode
    /// (`IDEMPOTENCY_NOT_RECORDED`, `IDEMPOTENCY_STORE_NOT_ENLISTABLE`).
    pub fn enlisted(mut self, enlisted: bool) -> Self {
        self.enlisted = enlisted;
        self
    }

    /// The key header parameter.
    pub fn key_parameter(&self) -> Parameter {
        let effective = self.effective();
        let presence = if effective.require_key {
            format!(
                "Required: a request without it is refused with {} `{}`.",
                self.config.missing_key_status().code(),
                ProblemCode::KeyRequired
            )
        } else {
            "Optional: a request without it runs unprotected, every time it is sent.".to_owned()
        };
        let description = format!(
            "Makes this request safe to repeat: a retry with the same key and the same request \
             gets the first answer, marked `{replayed}: true`, and the operation does not run \
             again. A different request under a key already used is refused with {reuse} `{reused}`; \
             a retry while the first is still running, with 409 `{in_progress}` and `Retry-After`.\n\n\
             1–{max} visible ASCII characters (0x21–0x7E), sent bare (a UUID, say; a bare key \
             may not contain `,`) or as a Structured-Field string (`\"…\"`, RFC 9651). Compared \
             exactly, and only among the caller's own keys. Sent once: two are refused with 400 \
             `{invalid}`.\n\n{presence}",
            replayed = display_header_name(REPLAYED_HEADER),
            reuse = effective.reuse_status.code(),
            reused = ProblemCode::KeyReused,
            in_progress = ProblemCode::InProgress,
            max = crate::key::MAX_KEY_LEN,
            invalid = ProblemCode::KeyInvalid,
        );
        ParameterBuilder::new()
            .name(self.key_header.clone())
            .parameter_in(ParameterIn::Header)
            .required(if effective.require_key {
                Required::True
            } else {
                Required::False
            })
            .description(Some(description))
            .schema(Some(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .min_length(Some(1)),
            ))
            .example(Some(serde_json::json!(
                "8e03978e-40d5-43e8-bc93-6894a57f9324"
            )))
            .build()
    }

    /// The refusals this operation can answer, by status, each with the codes it carries.
    fn refusals(&self) -> BTreeMap<u16, Vec<ProblemCode>> {
        let effective = self.effective();
        let mut by_status: BTreeMap<u16, Vec<ProblemCode>> = BTreeMap::new();
        let mut add = |status: u16, code| by_status.entry(status).or_default().push(code);
        add(400, ProblemCode::KeyInvalid);
        if effective.require_key {
            add(
                self.config.missing_key_status().code(),
                ProblemCode::KeyRequired,
            );
        }
        add(400, ProblemCode::BodyInvalid);
        add(413, ProblemCode::PayloadTooLarge);
        add(408, ProblemCode::BodyTimeout);
        add(500, ProblemCode::ScopeUnresolved);
        add(409, ProblemCode::InProgress);
        add(effective.reuse_status.code(), ProblemCode::KeyReused);
        add(503, ProblemCode::StoreUnavailable);
        add(503, ProblemCode::StoreFull);
        add(500, ProblemCode::HandlerPanicked);
        add(500, ProblemCode::Misconfigured);
        if self.enlisted {
            add(500, ProblemCode::NotRecorded);
            add(500, ProblemCode::StoreNotEnlistable);
        }
        by_status
    }

    /// The refusal response for `status`, carrying `codes`.
    fn refusal(&self, status: u16, codes: &[ProblemCode]) -> Response {
        let mut description = String::from("Refused by the idempotency layer:");
        for &code in codes {
            description.push_str(&format!(
                "\n- `{code}`: {}",
                example_body(status, code)["title"]
                    .as_str()
                    .unwrap_or_default()
            ));
        }
        let mut response = ResponseBuilder::new()
            .content(problem::CONTENT_TYPE, self.problem_content(status, codes));
        if codes.iter().copied().any(retried_after) {
            description.push_str("\n\nRetry after the `Retry-After` seconds.");
            response = response.header("Retry-After", retry_after_header());
        }
        response.description(description).build()
    }

    fn problem_content(&self, status: u16, codes: &[ProblemCode]) -> Content {
        let mut content = ContentBuilder::new().schema(Some(Ref::from_schema_name(PROBLEM_SCHEMA)));
        for &code in codes {
            content = content.examples_from_iter([(
                code.as_str(),
                ExampleBuilder::new()
                    .summary(code.as_str())
                    .value(Some(self.example(status, code))),
            )]);
        }
        content.build()
    }

    fn example(&self, status: u16, code: ProblemCode) -> serde_json::Value {
        let mut body = example_body(status, code);
        if code == ProblemCode::PayloadTooLarge {
            body["detail"] = format!(
                "the request body is larger than {} bytes",
                self.effective().max_body
            )
            .into();
        }
        body
    }

    fn effective(&self) -> Effective {
        self.endpoint.resolve(&self.config)
    }

    /// Adds the key parameter, the replay marker and the refusals to `operation`.
    ///
    /// What the operation already declares is kept: a header parameter of the same name is
    /// left as written; a response it declares for a refusal's status gets the refusal's
    /// `application/problem+json` beside its own content (both schemas, as `oneOf`, where it
    /// already had that media type); a response given as a `$ref` is left alone. Applying
    /// twice changes nothing more. The refusals refer to [`ProblemDetails`]: add it with
    /// [`register`] (or `components(schemas(ProblemDetails))`) when not applying through
    /// [`IdempotentPaths`].
    pub fn apply(&self, operation: &mut Operation) {
        self.add_key_parameter(operation);
        self.mark_replays(operation);
        for (status, codes) in self.refusals() {
            let ours = self.refusal(status, &codes);
            match operation.responses.responses.entry(status.to_string()) {
                std::collections::btree_map::Entry::Vacant(slot) => {
                    slot.insert(RefOr::T(ours));
                }
                std::collections::btree_map::Entry::Occupied(mut slot) => {
                    if let RefOr::T(theirs) = slot.get_mut() {
                        merge_refusal(theirs, ours);
                    }
                }
            }
        }
    }

    fn add_key_parameter(&self, operation: &mut Operation) {
        if self.key_header.is_empty() {
            // The key is in the body, which the operation's request body documents.
            return;
        }
        let parameters = operation.parameters.get_or_insert_with(Vec::new);
        let declared = parameters.iter().any(|p| {
            p.parameter_in == ParameterIn::Header && p.name.eq_ignore_ascii_case(&self.key_header)
        });
        if !declared {
            parameters.push(self.key_parameter());
        }
    }

    /// `Idempotency-Replayed` on each response the operation declared whose status the runtime
    /// records: any of them may be a replay.
    fn mark_replays(&self, operation: &mut Operation) {
        let effective = self.effective();
        let name = display_header_name(REPLAYED_HEADER);
        for (status, response) in &mut operation.responses.responses {
            let RefOr::T(response) = response else {
                continue;
            };
            let replayable = match status.parse::<u16>() {
                Ok(status) => effective
                    .recording
                    .is_recordable_status(&self.config, status),
                Err(_) => matches!(status.as_str(), "2XX" | "3XX" | "4XX"),
            };
            if replayable && !has_header(response, &name) && !only_refusals(response) {
                response.headers.insert(name.clone(), replayed_header());
            }
        }
    }
}

/// Applies an [`IdempotentOperation`] to the operations of a whole document, as a
/// [`utoipa::Modify`]: every POST and PATCH operation by default (what the attribute and the
/// layer apply to), other [`methods`](Self::methods), or only the operations listed with
/// [`only`](Self::only). Registers [`ProblemDetails`].
///
/// Endpoints with different settings take one `IdempotentPaths` each, each listing its own.
///
/// ```
/// use idempotent_runtime::openapi::{IdempotentOperation, IdempotentPaths};
/// use utoipa::Modify;
/// use utoipa::openapi::path::{HttpMethod, Operation, PathItem};
/// use utoipa::openapi::{Info, OpenApi, Paths};
///
/// let mut doc = OpenApi::new(
///     Info::new("shop", "1"),
///     Paths::builder()
///         .path("/orders", PathItem::new(HttpMethod::Post, Operation::new()))
///         .path("/refunds", PathItem::new(HttpMethod::Post, Operation::new())),
/// );
/// IdempotentPaths::new(IdempotentOperation::new().require_key(true))
///     .only("/orders", HttpMethod::Post)
///     .modify(&mut doc);
///
/// let json = serde_json::to_value(&doc).unwrap();
/// assert_eq!(json["paths"]["/orders"]["post"]["parameters"][0]["name"], "Idempotency-Key");
/// assert!(json["paths"]["/refunds"]["post"]["parameters"].is_null());
/// ```
#[derive(Clone)]
pub struct IdempotentPaths {
    operation: IdempotentOperation,
    methods: Vec<HttpMethod>,
    only: Vec<(String, HttpMethod)>,
}

impl IdempotentPaths {
    /// Every POST and PATCH operation of the document, described by `operation`.
    pub fn new(operation: IdempotentOperation) -> Self {
        Self {
            operation,
            methods: vec![HttpMethod::Post, HttpMethod::Patch],
            only: Vec::new(),
        }
    }

    /// Every operation with one of `methods`, in place of POST and PATCH (the
    /// [`methods` setting](crate::design) of the endpoints documented).
    pub fn methods(mut self, methods: impl IntoIterator<Item = HttpMethod>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Only the listed operations (call once per operation), whatever their method. Each must
    /// be in the document the modifier is applied to: a missing one panics when the document is
    /// built (see [`modify`](utoipa::Modify::modify)), so one modifier with `only` belongs to
    /// one document.
    pub fn only(mut self, path: impl Into<String>, method: HttpMethod) -> Self {
        self.only.push((path.into(), method));
        self
    }
}

impl utoipa::Modify for IdempotentPaths {
    /// # Panics
    ///
    /// When an operation named with [`only`](IdempotentPaths::only) is not in the document: a
    /// misspelt path would otherwise leave the endpoint undocumented without a word.
    fn modify(&self, doc: &mut OpenApi) {
        register(doc);
        if self.only.is_empty() {
            for item in doc.paths.paths.values_mut() {
                for method in &self.methods {
                    if let Some(operation) = operation_mut(item, method) {
                        self.operation.apply(operation);
                    }
                }
            }
            return;
        }
        for (path, method) in &self.only {
            let operation = doc
                .paths
                .paths
                .get_mut(path)
                .and_then(|item| operation_mut(item, method));
            match operation {
                Some(operation) => self.operation.apply(operation),
                None => panic!(
                    "IdempotentPaths::only: the document has no {} {path} operation",
                    method_name(method)
                ),
            }
        }
    }
}

impl fmt::Debug for IdempotentPaths {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let methods: Vec<&str> = self.methods.iter().map(method_name).collect();
        let only: Vec<String> = self
            .only
            .iter()
            .map(|(path, method)| format!("{} {path}", method_name(method)))
            .collect();
        f.debug_struct("IdempotentPaths")
            .field("operation", &self.operation)
            .field("methods", &methods)
            .field("only", &only)
            .finish()
    }
}

fn operation_mut<'a>(item: &'a mut PathItem, method: &HttpMethod) -> Option<&'a mut Operation> {
    match method {
        HttpMethod::Get => item.get.as_mut(),
        HttpMethod::Put => item.put.as_mut(),
        HttpMethod::Post => item.post.as_mut(),
        HttpMethod::Delete => item.delete.as_mut(),
        HttpMethod::Options => item.options.as_mut(),
        HttpMethod::Head => item.head.as_mut(),
        HttpMethod::Patch => item.patch.as_mut(),
        HttpMethod::Trace => item.trace.as_mut(),
    }
}

fn method_name(method: &HttpMethod) -> &'static str {
    match method {
        HttpMethod::Get => "GET",
        HttpMethod::Put => "PUT",
        HttpMethod::Post => "POST",
        HttpMethod::Delete => "DELETE",
        HttpMethod::Options => "OPTIONS",
        HttpMethod::Head => "HEAD",
        HttpMethod::Patch => "PATCH",
        HttpMethod::Trace => "TRACE",
    }
}

/// A refusal's response merged into the one the operation declared for the same status.
fn merge_refusal(theirs: &mut Response, ours: Response) {
    let Response {
        description,
        headers,
        mut content,
        ..
    } = ours;
    if !theirs.description.contains(&description) {
        if !theirs.description.is_empty() {
            theirs.description.push_str("\n\n");
        }
        theirs.description.push_str(&description);
    }
    for (name, header) in headers {
        if !has_header(theirs, &name) {
            theirs.headers.insert(name, header);
        }
    }
    let Some(ours) = content.shift_remove(problem::CONTENT_TYPE) else {
        return;
    };
    let Some(existing) = theirs.content.get_mut(problem::CONTENT_TYPE) else {
        theirs
            .content
            .insert(problem::CONTENT_TYPE.to_owned(), ours);
        return;
    };
    match existing.schema.take() {
        None => existing.schema = ours.schema,
        Some(schema) if refers_to_problem(&schema) => existing.schema = Some(schema),
        Some(schema) => {
            existing.schema = Some(
                OneOfBuilder::new()
                    .item(schema)
                    .item(Ref::from_schema_name(PROBLEM_SCHEMA))
                    .into(),
            );
        }
    }
    for (name, example) in ours.examples {
        existing.examples.entry(name).or_insert(example);
    }
}

/// Whether `schema` is, or is a `oneOf` with, the reference to [`ProblemDetails`].
fn refers_to_problem(schema: &RefOr<Schema>) -> bool {
    let location = format!("#/components/schemas/{PROBLEM_SCHEMA}");
    match schema {
        RefOr::Ref(r) => r.ref_location == location,
        RefOr::T(Schema::OneOf(one_of)) => one_of.items.iter().any(refers_to_problem),
        RefOr::T(_) => false,
    }
}

/// Whether `response` is one of the refusals [`IdempotentOperation::apply`] added: never a
/// replay, so never marked as one (and applying twice marks nothing more).
fn only_refusals(response: &Response) -> bool {
    !response.content.is_empty()
        && response.content.values().all(|content| {
            matches!(&content.schema, Some(schema @ RefOr::Ref(_)) if refers_to_problem(schema))
        })
}

fn has_header(response: &Response, name: &str) -> bool {
    response
        .headers
        .keys()
        .any(|h| h.eq_ignore_ascii_case(name))
}

/// The codes whose refusal carries `Retry-After`.
fn retried_after(code: ProblemCode) -> bool {
    matches!(
        code,
        ProblemCode::InProgress | ProblemCode::StoreUnavailable | ProblemCode::StoreFull
    )
}

fn retry_after_header() -> Header {
    HeaderBuilder::new()
        .schema(
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .minimum(Some(1)),
        )
        .description(Some(
            "Whole seconds to wait before retrying the same request with the same key.",
        ))
        .build()
}

fn replayed_header() -> Header {
    HeaderBuilder::new()
        .schema(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(["true"])),
        )
        .description(Some(
            "`true` when this is the recorded answer to an earlier request with the same key: \
             the operation did not run again. Absent on the first answer.",
        ))
        .build()
}

/// The body the runtime sends for `code`, rendered by [`Problem`] itself so the examples are
/// what clients get.
fn example_body(status: u16, code: ProblemCode) -> serde_json::Value {
    let mut problem = Problem::new(status, code, example_detail(code));
    if retried_after(code) {
        problem = problem.with_retry_after(1);
    }
    serde_json::from_slice(&problem.body()).expect("a problem body is JSON")
}

/// A `detail` as the runtime writes it; a code without an arm does not compile, so a new code
/// gets an example with it.
fn example_detail(code: ProblemCode) -> &'static str {
    match code {
        ProblemCode::InProgress => {
            "a request with this Idempotency-Key is still being processed; retry later"
        }
        ProblemCode::KeyReused => "this idempotency key was already used with a different request",
        ProblemCode::KeyRequired => "this endpoint requires an Idempotency-Key header",
        ProblemCode::KeyInvalid => {
            "the Idempotency-Key may contain only visible ASCII characters (0x21-0x7E)"
        }
        ProblemCode::PayloadTooLarge => "the request body is larger than 1048576 bytes",
        ProblemCode::BodyTimeout => "the request body did not arrive within 30 s",
        ProblemCode::BodyInvalid => "the request body could not be read to its end",
        ProblemCode::ScopeUnresolved => {
            "the caller's identity could not be established for this request"
        }
        ProblemCode::StoreUnavailable => "the idempotency store cannot be reached; retry later",
        ProblemCode::StoreFull => "the idempotency store has no room for this caller's request",
        ProblemCode::HandlerPanicked => {
            "the request failed; it may be retried with the same Idempotency-Key"
        }
        ProblemCode::NotRecorded => {
            "the response could not be recorded, so the request's changes were rolled back"
        }
        ProblemCode::StoreNotEnlistable => "this endpoint needs the PostgreSQL store",
        ProblemCode::Misconfigured => {
            "idempotency is misconfigured on this server (strict mode); its log names the fix"
        }
    }
}

/// `idempotency-key` → `Idempotency-Key`: how documents usually spell header names.
fn display_header_name(lowercase: &str) -> String {
    lowercase
        .split('-')
        .map(|word| {
            let mut chars = word.chars();
            match chars.next() {
                Some(first) => first.to_ascii_uppercase().to_string() + chars.as_str(),
                None => String::new(),
            }
        })
        .collect::<Vec<_>>()
        .join("-")
}

#[cfg(test)]
mod tests;
