use serde_json::{Value, json};
use utoipa::Modify;
use utoipa::openapi::content::ContentBuilder;
use utoipa::openapi::path::{HttpMethod, OperationBuilder, ParameterBuilder, PathItem};
use utoipa::openapi::{Info, OpenApi, Paths, Ref, ResponseBuilder};

use super::*;

/// A shop: an order created by POST, amended by PATCH, listed by GET.
fn shop() -> OpenApi {
    let created = OperationBuilder::new()
        .operation_id(Some("create_order"))
        .response(
            "201",
            ResponseBuilder::new()
                .description("Order created")
                .content("application/json", ContentBuilder::new().build()),
        )
        .build();
    let amended = OperationBuilder::new()
        .operation_id(Some("amend_order"))
        .response("200", ResponseBuilder::new().description("Order amended"))
        .build();
    let listed = OperationBuilder::new()
        .operation_id(Some("list_orders"))
        .response("200", ResponseBuilder::new().description("Orders"))
        .build();
    OpenApi::new(
        Info::new("shop", "1"),
        Paths::builder()
            .path("/orders", PathItem::new(HttpMethod::Post, created))
            .path("/orders", PathItem::new(HttpMethod::Get, listed))
            .path("/orders/{id}", PathItem::new(HttpMethod::Patch, amended)),
    )
}

fn json(doc: &OpenApi) -> Value {
    serde_json::to_value(doc).unwrap()
}

fn problem_ref() -> Value {
    json!({"$ref": "#/components/schemas/IdempotencyProblemDetails"})
}

/// The `code`s of a refusal response's examples, in order.
fn example_codes(response: &Value) -> Vec<String> {
    let examples = response["content"]["application/problem+json"]["examples"]
        .as_object()
        .unwrap_or_else(|| panic!("no problem examples in {response:#}"));
    examples
        .values()
        .map(|e| e["value"]["code"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn schema_code_enum_lists_every_problem_code() {
    let schema = serde_json::to_value(<ProblemDetails as utoipa::PartialSchema>::schema()).unwrap();
    let listed: Vec<&str> = schema["properties"]["code"]["enum"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    // `ALL` is built from one list checked by an exhaustive match (problem.rs): a variant
    // missing from it does not compile, so walking it walks every variant.
    for code in ProblemCode::ALL {
        assert!(
            listed.contains(&code.as_str()),
            "{code} missing from {listed:?}"
        );
    }
    assert_eq!(listed.len(), ProblemCode::ALL.len(), "{listed:?}");
    assert_eq!(
        schema["required"],
        json!(["type", "title", "status", "detail", "code"])
    );
    assert_eq!(schema["properties"]["status"]["type"], "integer");
    // The example is what the runtime sends.
    let sent: Value = serde_json::from_slice(
        &Problem::new(
            409,
            ProblemCode::InProgress,
            example_detail(ProblemCode::InProgress),
        )
        .body(),
    )
    .unwrap();
    assert_eq!(schema["examples"][0], sent);
}

#[test]
fn document_gets_the_key_header_and_the_refusals_on_post_and_patch() {
    let mut doc = shop();
    IdempotentPaths::new(IdempotentOperation::new().require_key(true)).modify(&mut doc);
    let doc = json(&doc);

    assert_eq!(
        doc["components"]["schemas"]["IdempotencyProblemDetails"],
        serde_json::to_value(<ProblemDetails as utoipa::PartialSchema>::schema()).unwrap()
    );
    for operation in [
        &doc["paths"]["/orders"]["post"],
        &doc["paths"]["/orders/{id}"]["patch"],
    ] {
        let parameters = operation["parameters"].as_array().unwrap();
        assert_eq!(parameters.len(), 1, "{parameters:#?}");
        let key = &parameters[0];
        assert_eq!(key["name"], "Idempotency-Key");
        assert_eq!(key["in"], "header");
        assert_eq!(key["required"], true);
        assert_eq!(key["schema"], json!({"type": "string", "minLength": 1}));
        let description = key["description"].as_str().unwrap();
        for needle in [
            "1–255 visible ASCII",
            "Structured-Field string",
            "400 `IDEMPOTENCY_KEY_REQUIRED`",
        ] {
            assert!(
                description.contains(needle),
                "{needle:?} not in {description:?}"
            );
        }

        let responses = operation["responses"].as_object().unwrap();
        let statuses: Vec<&str> = responses.keys().map(String::as_str).collect();
        let declared = if operation["operationId"] == "create_order" {
            "201"
        } else {
            "200"
        };
        let mut expected = vec![declared, "400", "408", "409", "413", "422", "500", "503"];
        expected.sort();
        assert_eq!(statuses, expected);
        for status in ["400", "408", "409", "413", "422", "500", "503"] {
            let response = &responses[status];
            let content = response["content"].as_object().unwrap();
            assert_eq!(content.len(), 1, "{status}: {content:#?}");
            assert_eq!(
                content["application/problem+json"]["schema"],
                problem_ref(),
                "{status}"
            );
            let retry_after = &response["headers"]["Retry-After"];
            if ["409", "503"].contains(&status) {
                assert_eq!(
                    retry_after["schema"],
                    json!({"type": "integer", "minimum": 1})
                );
            } else {
                assert!(retry_after.is_null(), "{status}: {response:#}");
            }
            assert!(
                response["headers"]["Idempotency-Replayed"].is_null(),
                "{status}"
            );
        }
        assert_eq!(
            example_codes(&responses["400"]),
            [
                "IDEMPOTENCY_BODY_INVALID",
                "IDEMPOTENCY_KEY_INVALID",
                "IDEMPOTENCY_KEY_REQUIRED"
            ]
        );
        assert_eq!(
            example_codes(&responses["409"]),
            ["IDEMPOTENCY_IN_PROGRESS"]
        );
        assert_eq!(example_codes(&responses["422"]), ["IDEMPOTENCY_KEY_REUSED"]);
        assert_eq!(
            example_codes(&responses["413"]),
            ["IDEMPOTENCY_PAYLOAD_TOO_LARGE"]
        );
        assert_eq!(
            example_codes(&responses["408"]),
            ["IDEMPOTENCY_BODY_TIMEOUT"]
        );
        assert_eq!(
            example_codes(&responses["500"]),
            [
                "IDEMPOTENCY_HANDLER_PANICKED",
                "IDEMPOTENCY_MISCONFIGURED",
                "IDEMPOTENCY_SCOPE_UNRESOLVED"
            ]
        );
        assert_eq!(
            example_codes(&responses["503"]),
            ["IDEMPOTENCY_STORE_FULL", "IDEMPOTENCY_STORE_UNAVAILABLE"]
        );
        let example = &responses["409"]["content"]["application/problem+json"]["examples"]["IDEMPOTENCY_IN_PROGRESS"]
            ["value"];
        assert_eq!(example["status"], 409);
        assert_eq!(
            example["title"],
            "A request with this Idempotency-Key is in progress"
        );

        let replayed = &responses[declared]["headers"]["Idempotency-Replayed"];
        assert_eq!(
            replayed["schema"],
            json!({"type": "string", "enum": ["true"]})
        );
    }
    // GET is not idempotent-handled: untouched.
    let get = &doc["paths"]["/orders"]["get"];
    assert!(get["parameters"].is_null(), "{get:#}");
    assert_eq!(get["responses"].as_object().unwrap().len(), 1, "{get:#}");
    assert!(get["responses"]["200"]["headers"].is_null(), "{get:#}");
}

#[test]
fn optional_key_is_an_optional_parameter_and_never_key_required() {
    let mut operation = Operation::new();
    IdempotentOperation::new().apply(&mut operation);
    let operation = serde_json::to_value(&operation).unwrap();
    assert_eq!(operation["parameters"][0]["required"], false);
    assert!(
        operation["parameters"][0]["description"]
            .as_str()
            .unwrap()
            .contains("Optional: a request without it runs unprotected")
    );
    assert_eq!(
        example_codes(&operation["responses"]["400"]),
        ["IDEMPOTENCY_BODY_INVALID", "IDEMPOTENCY_KEY_INVALID"]
    );
    assert!(operation["responses"]["428"].is_null());
}

#[test]
fn settings_choose_the_header_name_and_the_statuses() {
    let config = Config::builder()
        .key_header("x-request-key")
        .missing_key_status(MissingKeyStatus::PreconditionRequired)
        .reuse_status(ReuseStatus::Conflict)
        .max_body(64 * 1024)
        .build();
    let mut operation = Operation::new();
    IdempotentOperation::from_config(&config)
        .require_key(true)
        .enlisted(true)
        .apply(&mut operation);
    let operation = serde_json::to_value(&operation).unwrap();
    let responses = &operation["responses"];

    assert_eq!(operation["parameters"][0]["name"], "X-Request-Key");
    assert_eq!(
        example_codes(&responses["428"]),
        ["IDEMPOTENCY_KEY_REQUIRED"]
    );
    assert_eq!(
        example_codes(&responses["400"]),
        ["IDEMPOTENCY_BODY_INVALID", "IDEMPOTENCY_KEY_INVALID"]
    );
    assert_eq!(
        example_codes(&responses["409"]),
        ["IDEMPOTENCY_IN_PROGRESS", "IDEMPOTENCY_KEY_REUSED"]
    );
    assert!(responses["409"]["headers"]["Retry-After"].is_object());
    assert!(responses["422"].is_null(), "{responses:#}");
    assert_eq!(
        example_codes(&responses["500"]),
        [
            "IDEMPOTENCY_HANDLER_PANICKED",
            "IDEMPOTENCY_MISCONFIGURED",
            "IDEMPOTENCY_NOT_RECORDED",
            "IDEMPOTENCY_SCOPE_UNRESOLVED",
            "IDEMPOTENCY_STORE_NOT_ENLISTABLE"
        ]
    );
    assert_eq!(
        responses["413"]["content"]["application/problem+json"]["examples"]["IDEMPOTENCY_PAYLOAD_TOO_LARGE"]
            ["value"]["detail"],
        "the request body is larger than 65536 bytes"
    );

    // An endpoint's overrides win over the service's, as at run time.
    let mut operation = Operation::new();
    IdempotentOperation::from_config(&config)
        .endpoint(EndpointConfig {
            reuse_status: Some(ReuseStatus::UnprocessableContent),
            ..EndpointConfig::REQUIRED
        })
        .apply(&mut operation);
    let operation = serde_json::to_value(&operation).unwrap();
    assert_eq!(operation["parameters"][0]["required"], true);
    assert_eq!(
        example_codes(&operation["responses"]["422"]),
        ["IDEMPOTENCY_KEY_REUSED"]
    );
    assert_eq!(
        example_codes(&operation["responses"]["409"]),
        ["IDEMPOTENCY_IN_PROGRESS"]
    );
}

#[test]
fn replay_marker_follows_the_recorded_statuses() {
    let mut operation = OperationBuilder::new()
        .response("201", ResponseBuilder::new().description("created"))
        .response("404", ResponseBuilder::new().description("no such shop"))
        .response("401", ResponseBuilder::new().description("who are you"))
        .response("502", ResponseBuilder::new().description("upstream"))
        .build();
    IdempotentOperation::new().apply(&mut operation);
    let responses = serde_json::to_value(&operation).unwrap()["responses"].clone();
    // 201 and 404 are recorded and replayed; 401 is never recorded by default, 5xx never.
    assert!(responses["201"]["headers"]["Idempotency-Replayed"].is_object());
    assert!(responses["404"]["headers"]["Idempotency-Replayed"].is_object());
    assert!(responses["401"]["headers"].is_null(), "{responses:#}");
    assert!(responses["502"]["headers"].is_null(), "{responses:#}");
}

#[test]
fn declared_parameter_and_responses_are_kept_and_merged() {
    let their_error = Ref::from_schema_name("ApiError");
    let mut operation = OperationBuilder::new()
        .parameter(
            ParameterBuilder::new()
                .name("idempotency-key")
                .parameter_in(ParameterIn::Header)
                .description(Some("ours")),
        )
        .response(
            "400",
            ResponseBuilder::new().description("Invalid order").content(
                "application/json",
                ContentBuilder::new()
                    .schema(Some(their_error.clone()))
                    .build(),
            ),
        )
        .response(
            "409",
            ResponseBuilder::new()
                .description("Order already shipped")
                .content(
                    "application/problem+json",
                    ContentBuilder::new().schema(Some(their_error)).build(),
                ),
        )
        .response("503", Ref::from_response_name("Maintenance"))
        .build();
    let docs = IdempotentOperation::new().require_key(true);
    docs.apply(&mut operation);
    let once = serde_json::to_value(&operation).unwrap();

    let parameters = once["parameters"].as_array().unwrap();
    assert_eq!(parameters.len(), 1);
    assert_eq!(parameters[0]["description"], "ours");

    let bad_request = &once["responses"]["400"];
    assert!(
        bad_request["description"]
            .as_str()
            .unwrap()
            .starts_with("Invalid order\n\nRefused by the idempotency layer:")
    );
    assert_eq!(
        bad_request["content"]["application/json"]["schema"],
        json!({"$ref": "#/components/schemas/ApiError"})
    );
    assert_eq!(
        bad_request["content"]["application/problem+json"]["schema"],
        problem_ref()
    );
    // Their 400 may be a recorded answer replayed.
    assert!(bad_request["headers"]["Idempotency-Replayed"].is_object());

    let conflict = &once["responses"]["409"];
    assert_eq!(
        conflict["content"]["application/problem+json"]["schema"],
        json!({"oneOf": [{"$ref": "#/components/schemas/ApiError"}, problem_ref()]})
    );
    assert_eq!(example_codes(conflict), ["IDEMPOTENCY_IN_PROGRESS"]);
    assert!(conflict["headers"]["Retry-After"].is_object());

    assert_eq!(
        once["responses"]["503"],
        json!({"$ref": "#/components/responses/Maintenance"})
    );

    docs.apply(&mut operation);
    assert_eq!(
        serde_json::to_value(&operation).unwrap(),
        once,
        "applying twice adds nothing"
    );
}

#[test]
fn only_lists_the_operations_documented() {
    let mut doc = shop();
    IdempotentPaths::new(IdempotentOperation::new())
        .only("/orders/{id}", HttpMethod::Patch)
        .modify(&mut doc);
    let doc = json(&doc);
    assert!(
        doc["paths"]["/orders"]["post"]["parameters"].is_null(),
        "{doc:#}"
    );
    assert!(doc["paths"]["/orders"]["post"]["responses"]["409"].is_null());
    assert_eq!(
        doc["paths"]["/orders/{id}"]["patch"]["parameters"][0]["name"],
        "Idempotency-Key"
    );

    let mut doc = shop();
    IdempotentPaths::new(IdempotentOperation::new())
        .methods([HttpMethod::Patch])
        .modify(&mut doc);
    let doc = json(&doc);
    assert!(
        doc["paths"]["/orders"]["post"]["parameters"].is_null(),
        "{doc:#}"
    );
    assert!(doc["paths"]["/orders/{id}"]["patch"]["parameters"].is_array());
}

#[test]
#[should_panic(expected = "IdempotentPaths::only: the document has no POST /order operation")]
fn only_refuses_an_operation_the_document_lacks() {
    IdempotentPaths::new(IdempotentOperation::new())
        .only("/order", HttpMethod::Post)
        .modify(&mut shop());
}

#[test]
fn header_names_are_shown_capitalized() {
    assert_eq!(display_header_name("idempotency-key"), "Idempotency-Key");
    assert_eq!(display_header_name("x-request-key"), "X-Request-Key");
    assert_eq!(
        display_header_name("idempotency-replayed"),
        "Idempotency-Replayed"
    );
}

#[test]
fn an_endpoints_key_source_chooses_the_documented_header() {
    use crate::key::KeySource;

    let mut webhook = Operation::new();
    IdempotentOperation::new()
        .endpoint(EndpointConfig::REQUIRED.key(KeySource::header_static("webhook-id")))
        .apply(&mut webhook);
    let webhook = serde_json::to_value(&webhook).unwrap();
    assert_eq!(webhook["parameters"][0]["name"], "Webhook-Id");
    assert_eq!(webhook["parameters"][0]["required"], true);

    let mut event = Operation::new();
    IdempotentOperation::new()
        .endpoint(EndpointConfig::REQUIRED.key(KeySource::body_static("/id")))
        .apply(&mut event);
    let event = serde_json::to_value(&event).unwrap();
    assert!(
        event["parameters"].as_array().is_none_or(Vec::is_empty),
        "a key in the body is no header parameter: {event:#}"
    );
    assert_eq!(
        example_codes(&event["responses"]["400"]),
        [
            "IDEMPOTENCY_BODY_INVALID",
            "IDEMPOTENCY_KEY_INVALID",
            "IDEMPOTENCY_KEY_REQUIRED"
        ]
    );
}
