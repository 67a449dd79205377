//! `api`: one Open API call with the configured credentials.

use super::{load_with, ApiArgs, CliError, ConfigArgs};
use handoff_bridge::config::{Config, Overrides};

/// `handoff-bridge api`: load the config (`--upstream` over it), then make the call.
pub(super) fn api_command(args: &ConfigArgs, call: ApiArgs) -> Result<(), CliError> {
    let overrides = Overrides {
        upstream: call.upstream.clone(),
        ..Overrides::default()
    };
    let config = load_with(args, overrides)?;
    api(&config, call)
}

/// `handoff-bridge api`: one call, printed as JSON.
fn api(config: &Config, args: ApiArgs) -> Result<(), CliError> {
    use model::contract::Endpoint;
    use upstream::{ApiCall, Execute};
    if args.list {
        for e in Endpoint::ALL {
            out!("{:<28} {:<6} {}", e.name(), e.method(), e.path_template());
        }
        return Ok(());
    }
    let name = args.endpoint.unwrap_or_default();
    let endpoint = Endpoint::from_name(&name).ok_or_else(|| {
        CliError::Usage(format!(
            "unknown endpoint {name:?}; see `handoff-bridge api --list`"
        ))
    })?;
    let params: Vec<&str> = args.params.iter().map(String::as_str).collect();
    let mut call = ApiCall::new(endpoint, &params);
    call.query = args
        .query
        .iter()
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .ok_or_else(|| CliError::Usage(format!("--query {kv:?} is not KEY=VALUE")))
        })
        .collect::<Result<_, _>>()?;
    if let Some(body) = args.body {
        let text = match body.strip_prefix('@') {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| CliError::Usage(format!("--body @{path}: {e}")))?,
            None => body,
        };
        call.body = Some(
            serde_json::from_str(&text)
                .map_err(|e| CliError::Usage(format!("--body is not JSON: {e}")))?,
        );
    }
    call.idempotency_key = args.idempotency_key;
    call.path_and_query()
        .map_err(|e| CliError::Usage(e.to_string()))?;
    let settings = config.upstream.client_settings().map_err(CliError::Usage)?;
    let limits = upstream::limits::Limits::new(&config.upstream.limits).map_err(CliError::Usage)?;
    let up = &config.upstream;
    let result = actix_web::rt::System::new().block_on(async move {
        if up.is_embedded() {
            return Err(upstream::UpstreamError::InvalidCall(
                "upstream is \"embedded\": give --upstream URL (e.g. a running `handoff-bridge emulator`)".into(),
            ));
        }
        let tls = upstream::tls::ClientTls::new(&upstream::tls::Trust::load(), &up.ca_file, "upstream", None)
            .map_err(|e| upstream::UpstreamError::InvalidCall(format!("upstream.ca_file: {e}")))?;
        let transport = upstream::transport::AwcTransport::new(&up.url, up.connect_timeout, up.request_timeout, tls);
        upstream::Client::new(transport, settings, limits).execute(call).await
    });
    match result {
        Ok(value) => {
            out!(
                "{}",
                serde_json::to_string_pretty(&value).unwrap_or_default()
            );
            Ok(())
        }
        Err(e) => {
            if let upstream::UpstreamError::Status { body, .. } = &e {
                out!("{body}");
            }
            Err(CliError::Upstream(e))
        }
    }
}
