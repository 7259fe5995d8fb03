//! Clients as users run them: the official `openai` Python client against real routers and
//! engine-sims (`tests/clients/openai_compat.py` holds the checks).

use crate::{scratch_dir, Proc};

#[test]
fn the_official_openai_client_works_through_the_router() {
    let venv = crate::test_venv();
    let engine = crate::engine_sim("1000", &[]);
    // The README's "Run a gateway": instances by flag, no keys, nothing else.
    let open = Proc::start(&[
        "router",
        "--listen",
        "127.0.0.1:0",
        "--instance",
        &engine.url,
    ]);
    // A keyed router: a rate-limited tenant, and a tenant whose pool's instance is down.
    let dir = scratch_dir("openai-client");
    let config = dir.join("router.toml");
    std::fs::write(
        &config,
        format!(
            "version = 1\n\
             [[pools]]\nmodel = \"sim-llama\"\ninstances = [\"{}\"]\n\
             [[pools]]\nmodel = \"dead-llama\"\ninstances = [\"http://127.0.0.1:9\"]\n\
             [[tenants]]\nid = \"acme\"\napi_keys = [\"sk-acme\"]\npool = \"sim-llama\"\n\
             rate_limit_rps = 0.1\n\
             [[tenants]]\nid = \"ghost\"\napi_keys = [\"sk-ghost\"]\npool = \"dead-llama\"\n",
            engine.url
        ),
    )
    .expect("config written");
    let keyed = Proc::start(&[
        "router",
        "--listen",
        "127.0.0.1:0",
        "--config",
        config.to_str().expect("utf-8 path"),
    ]);
    crate::run_client_checks(
        &venv.join("bin/python"),
        "openai_compat.py",
        &[&open.url, &keyed.url],
    );
}
