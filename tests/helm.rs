//! `deploy/helm/warmpath`, with the real tools (Helm and the Kubernetes API schemas, from
//! the tests' venv): the chart lints; every rendering (defaults, everything on, the tiers
//! off, a directory L2) passes the Kubernetes schemas strictly; the values schema refuses
//! bad input with a message that names the value; and the pods run as rendered: the
//! StatefulSet's script, the DaemonSet's arguments, the ConfigMap and the Secrets the chart
//! made (its random tokens, its CA and certificates) start real routers and a real agent
//! that form a Raft cluster with a learner, gossip, follow the agent over mutual TLS and
//! serve a request.
//!
//! No Kubernetes cluster runs here, so each pod runs as a process: its volumes become
//! directories holding what the ConfigMap and Secrets hold, and its own network becomes a
//! loopback address of its own (127.0.0.N), standing in for the pod IP, for a wildcard
//! bind and for the stable DNS name of its StatefulSet pod.

use crate::{free_addr, scratch_dir, until, warmpath_bin, Proc};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const RELEASE: &str = "wp";
const NAMESPACE: &str = "llm";
/// The oldest Kubernetes the chart supports (Chart.yaml's kubeVersion) and a current one.
const KUBERNETES: [&str; 2] = ["1.25.0", "1.33.0"];

fn chart() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/helm/warmpath")
}

pub(crate) fn tool(name: &str) -> PathBuf {
    crate::test_venv().join("bin").join(name)
}

/// `helm template` of the chart with `values`: the manifests, or what Helm said.
fn render(values: &Value) -> Result<String, String> {
    // Tests render in parallel: each rendering its own values file.
    static RENDERINGS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = RENDERINGS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let file = scratch_dir("helm-render").join(format!("values-{n}.json"));
    std::fs::write(&file, values.to_string()).expect("write values");
    let out = Command::new(tool("helm"))
        .args(["template", RELEASE])
        .arg(chart())
        .args(["--namespace", NAMESPACE, "--values"])
        .arg(&file)
        .output()
        .expect("helm runs");
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).expect("utf-8 manifests"))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// A YAML stream's documents as JSON (the venv's PyYAML reads them), the data of each
/// Kubernetes Secret decoded.
pub(crate) fn documents(manifests: &str) -> Vec<Value> {
    let script = "import base64, json, sys, yaml\n\
        docs = [d for d in yaml.safe_load_all(sys.stdin) if d]\n\
        for d in docs:\n\
        \x20   if isinstance(d, dict) and d.get('kind') == 'Secret':\n\
        \x20       d['data'] = {k: base64.b64decode(v).decode() for k, v in d['data'].items()}\n\
        json.dump(docs, sys.stdout)\n";
    let mut child = Command::new(tool("python"))
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python runs");
    use std::io::Write;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(manifests.as_bytes())
        .expect("write the manifests");
    let out = child.wait_with_output().expect("python's output");
    assert!(out.status.success(), "not YAML: {manifests}");
    serde_json::from_slice(&out.stdout).expect("JSON from python")
}

fn kinds(docs: &[Value]) -> Vec<String> {
    let mut kinds: Vec<String> = docs
        .iter()
        .map(|d| d["kind"].as_str().unwrap_or_default().to_string())
        .collect();
    kinds.sort();
    kinds
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in the rendering"))
}

/// Values with everything on: 7 routers of which 5 vote, both tiers (Redis L2), a pool
/// with agents, a tenant, router settings, the ServiceMonitor.
fn everything_on() -> Value {
    json!({
        "kvCacheSpec": {"enableL1Cache": true, "l1CacheSize": "64GiB", "enableL2Cache": true,
                        "l2CacheBackend": "redis", "l2CacheUrl": "redis://redis.llm:6379/2"},
        "intelligentRoutingSpec": {"enabled": true, "routingStrategy": "kvaware"},
        "router": {
            "replicas": 7, "raft": {"voters": 5},
            "pools": [{"model": "llama", "instances": ["http://vllm-0.vllm:8000"],
                       "agents": ["agent@10.0.3.17:7700"], "tokenizer": "builtin",
                       "block_tokens": 16, "adapters": ["sql-lora"]}],
            "tenants": [{"id": "acme", "api_key_hashes": ["ab".repeat(32)],
                         "strategy": "least-loaded", "rate_limit_rps": 50}],
            "settings": {"retries": 2, "request_timeout_ms": 600000},
        },
        "agent": {"kvEvents": ["http://$(NODE_IP):8000=tcp://$(NODE_IP):5557"],
                  "kvTenants": ["acme"], "kvBlockTokens": 16},
        "metrics": {"serviceMonitor": {"enabled": true}},
    })
}

/// `helm lint --strict`, then each rendering validated strictly (unknown fields refused)
/// against the Kubernetes API schemas of the oldest supported and a current release. The
/// ServiceMonitor, a Prometheus Operator resource with no schema there, is checked by hand:
/// it selects the Services that carry a `metrics` port.
#[test]
fn the_chart_lints_and_every_rendering_passes_the_kubernetes_schemas() {
    let out = Command::new(tool("helm"))
        .args(["lint", "--strict"])
        .arg(chart())
        .output()
        .expect("helm runs");
    assert!(
        out.status.success(),
        "helm lint: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = scratch_dir("helm-validate");
    let variants = [
        ("defaults", json!({})),
        ("everything-on", everything_on()),
        (
            "tiers-off",
            json!({"kvCacheSpec": {"enableL1Cache": false, "enableL2Cache": false},
                   "intelligentRoutingSpec": {"enabled": false},
                   "router": {"replicas": 1, "raft": {"voters": 1}},
                   "metrics": {"grafanaDashboard": {"enabled": false}}}),
        ),
        (
            "dir-l2",
            json!({"kvCacheSpec": {"enableL2Cache": true, "l2CacheBackend": "dir",
                                   "l2CacheSize": "500GiB"},
                   "agent": {"l2Volume": {"hostPath": {"path": "/mnt/nvme/warmpath",
                                                       "type": "DirectoryOrCreate"}}}}),
        ),
        (
            "hyperpod",
            json!({"agent": {"kvBlockTokens": 16,
                             "kvEvents": ["http://$(NODE_IP):8000=tcp://$(NODE_IP):5557"],
                             "hyperpod": {"enabled": true, "shmBytes": "32GiB",
                                          "lmcache": {"chunkSize": 256}}}}),
        ),
    ];
    for (name, values) in variants {
        let manifests = render(&values).unwrap_or_else(|e| panic!("{name}: {e}"));
        let file = dir.join(format!("{name}.yaml"));
        std::fs::write(&file, &manifests).expect("write the manifests");
        for version in KUBERNETES {
            let out = Command::new(tool("kubernetes-validate"))
                .args(["--strict", "--quiet", "-k", version])
                .arg(&file)
                .output()
                .expect("kubernetes-validate runs");
            let said = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            let unexplained: Vec<&str> = said
                .lines()
                .filter(|l| !l.contains("Couldn't find schema for kind ServiceMonitor"))
                .filter(|l| !l.trim().is_empty())
                .collect();
            assert!(
                out.status.success() && unexplained.is_empty(),
                "{name} against Kubernetes {version}: {said}"
            );
        }
        let docs = documents(&manifests);
        let kinds = kinds(&docs);
        let count = |k: &str| kinds.iter().filter(|x| *x == k).count();
        assert_eq!(count("StatefulSet"), 1, "{name}: {kinds:?}");
        match name {
            "everything-on" => {
                assert_eq!(count("DaemonSet"), 1);
                assert_eq!(count("ServiceMonitor"), 1);
                assert_eq!(count("PodDisruptionBudget"), 1);
                let pdb = find(&docs, "PodDisruptionBudget", "wp-warmpath-router");
                // 5 voters keep a quorum with 2 away.
                assert_eq!(pdb["spec"]["maxUnavailable"], 2);
                let monitor = &docs[kinds_index(&docs, "ServiceMonitor")];
                let wanted = &monitor["spec"]["selector"]["matchExpressions"][0]["values"];
                for service in docs.iter().filter(|d| d["kind"] == "Service") {
                    let component = &service["metadata"]["labels"]["app.kubernetes.io/component"];
                    let has_metrics = service["spec"]["ports"]
                        .as_array()
                        .is_some_and(|p| p.iter().any(|p| p["name"] == "metrics"));
                    let selected = wanted.as_array().unwrap().contains(component);
                    assert_eq!(selected, has_metrics, "{service}");
                }
                assert_eq!(monitor["spec"]["endpoints"][0]["port"], "metrics");
                let args = daemonset_args(&docs);
                crate::deploy::assert_real_flags("the agent DaemonSet", "agent", &args.join(" "));
                let script = find(&docs, "StatefulSet", "wp-warmpath-router")["spec"]["template"]
                    ["spec"]["containers"][0]["args"][0]
                    .as_str()
                    .expect("the router script")
                    .to_string();
                crate::deploy::assert_real_flags("the router StatefulSet", "router", &script);
                assert!(args.contains(&"--l2=redis://redis.llm:6379/2".to_string()));
                assert!(args.contains(&"--l1-bytes=64GiB".to_string()));
                assert!(args.contains(&"--kv-block-tokens=16".to_string()));
                let config = router_config(&docs);
                assert!(config.contains("strategy = \"kv-aware\""), "{config}");
                assert!(config.contains("adapters = [\"sql-lora\"]"), "{config}");
                assert!(config.contains("retries = 2"), "{config}");
            }
            "tiers-off" => {
                assert_eq!(count("DaemonSet"), 0, "no agent without a tier");
                assert_eq!(
                    count("PodDisruptionBudget"),
                    0,
                    "one voter has no quorum to keep"
                );
                assert_eq!(count("ConfigMap"), 1, "the dashboard is off");
                assert!(router_config(&docs).contains("strategy = \"round-robin\""));
            }
            "hyperpod" => {
                // The agent as LMCache's HyperPod daemon: its API on the node's loopback
                // (hostNetwork: LMCache's connector sends no token), its segment in the
                // node's /dev/shm, and the settings an engine's LMCache needs.
                let args = daemonset_args(&docs);
                crate::deploy::assert_real_flags("the agent DaemonSet", "agent", &args.join(" "));
                for flag in [
                    "--hyperpod-listen=127.0.0.1:9200",
                    "--hyperpod-shm-name=warmpath-kv",
                    "--hyperpod-shm-bytes=32GiB",
                    "--hyperpod-shm-mode=0660",
                    "--kv-block-tokens=16",
                ] {
                    assert!(args.contains(&flag.to_string()), "{flag}: {args:?}");
                }
                let pod =
                    &find(&docs, "DaemonSet", "wp-warmpath-agent")["spec"]["template"]["spec"];
                assert_eq!(pod["hostNetwork"], true, "{pod}");
                assert_eq!(pod["dnsPolicy"], "ClusterFirstWithHostNet");
                let shm = pod["volumes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|v| v["name"] == "shm")
                    .expect("the shm volume");
                assert_eq!(shm["hostPath"]["path"], "/dev/shm");
                let mounts = &pod["containers"][0]["volumeMounts"];
                assert!(
                    mounts
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|m| m["name"] == "shm" && m["mountPath"] == "/dev/shm"),
                    "{mounts}"
                );
                let env = &find(&docs, "ConfigMap", "wp-warmpath-agent-lmcache")["data"];
                assert_eq!(
                    env["LMCACHE_REMOTE_URL"],
                    "sagemaker-hyperpod://127.0.0.1:9200"
                );
                assert_eq!(env["LMCACHE_CHUNK_SIZE"], "256");
                assert_eq!(env["LMCACHE_ENABLE_KV_EVENTS"], "true");
                let extra: Value =
                    serde_json::from_str(env["LMCACHE_EXTRA_CONFIG"].as_str().unwrap()).unwrap();
                assert_eq!(
                    extra["sagemaker_hyperpod_shared_memory_name"],
                    "warmpath-kv"
                );
            }
            "dir-l2" => {
                let args = daemonset_args(&docs);
                assert!(args.contains(&"--l2=dir:/var/lib/warmpath/l2".to_string()));
                assert!(args.contains(&"--l2-bytes=500GiB".to_string()));
            }
            _ => {
                assert_eq!(count("DaemonSet"), 1);
                assert!(router_config(&docs).contains("strategy = \"prefix-aware\""));
                // The dashboard the chart provisions is deploy/grafana's.
                let dashboard = find(&docs, "ConfigMap", "wp-warmpath-dashboard");
                let ours = std::fs::read_to_string(
                    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/warmpath.json"),
                )
                .expect("the dashboard");
                assert_eq!(
                    dashboard["data"]["warmpath.json"].as_str(),
                    Some(ours.trim_end())
                );
            }
        }
    }
}

fn kinds_index(docs: &[Value], kind: &str) -> usize {
    docs.iter()
        .position(|d| d["kind"] == kind)
        .expect("the kind")
}

fn daemonset_args(docs: &[Value]) -> Vec<String> {
    let ds = find(docs, "DaemonSet", "wp-warmpath-agent");
    serde_json::from_value(ds["spec"]["template"]["spec"]["containers"][0]["args"].clone())
        .expect("the agent's args")
}

fn router_config(docs: &[Value]) -> String {
    find(docs, "ConfigMap", "wp-warmpath-router")["data"]["router.toml"]
        .as_str()
        .expect("router.toml")
        .to_string()
}

/// A bad value fails the install with the value's path and what is wrong, from the values
/// schema or, for what a schema cannot say (replicas against voters), the templates.
#[test]
fn the_values_schema_refuses_bad_input_with_a_clear_message() {
    let cases = [
        (
            json!({"kvCacheSpec": {"l1CacheSize": "lots"}}),
            "kvCacheSpec.l1CacheSize",
        ),
        (
            json!({"intelligentRoutingSpec": {"routingStrategy": "fastest"}}),
            "routingStrategy must be one of the following",
        ),
        (
            json!({"router": {"raft": {"voters": 4}}}),
            "router.raft.voters must be one of",
        ),
        (
            json!({"router": {"replicas": 2}}),
            "router.replicas (2) is fewer than router.raft.voters (3)",
        ),
        (
            json!({"kvCacheSpec": {"enableL2Cache": true}}),
            "kvCacheSpec.l2CacheUrl is empty",
        ),
        (
            json!({"kvCacheSpec": {"l2CacheUrl": "http://redis:6379"}}),
            "kvCacheSpec.l2CacheUrl",
        ),
        (
            json!({"routr": {"replicas": 3}}),
            "Additional property routr is not allowed",
        ),
        (
            json!({"router": {"tenants": [{"id": "acme", "api_keys": ["sk-1"]}]}}),
            "Additional property api_keys is not allowed",
        ),
        (
            json!({"router": {"pools": [{"model": "m", "instances": ["vllm:8000"]}]}}),
            "router.pools.0.instances.0",
        ),
        (
            json!({"router": {"ports": {"http": 70000}}}),
            "router.ports.http",
        ),
        (
            json!({"router": {"settings": {"listen": "0.0.0.0:1"}}}),
            "Additional property listen is not allowed",
        ),
        (
            json!({"router": {"settings": {"retries": -1}}}),
            "router.settings.retries",
        ),
    ];
    for (values, message) in cases {
        match render(&values) {
            Ok(_) => panic!("{values} was accepted"),
            Err(e) => assert!(e.contains(message), "{values}: {e}"),
        }
    }
}

/// The schema's `router.settings` are the router's `[router]` table (as
/// `node/src/router/config.rs` declares it), less the addresses the chart sets itself.
#[test]
fn the_schemas_router_settings_are_the_routers_own() {
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(chart().join("values.schema.json")).expect("the schema"),
    )
    .expect("JSON");
    let settings = &schema["properties"]["router"]["properties"]["settings"]["properties"];
    let mut ours: Vec<String> = settings
        .as_object()
        .expect("settings")
        .keys()
        .cloned()
        .collect();
    ours.sort();
    let source =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/router/config.rs"))
            .expect("config.rs");
    let section = source
        .split("pub struct RouterSection {")
        .nth(1)
        .and_then(|s| s.split("\n}").next())
        .expect("RouterSection");
    let mut fields: Vec<String> = section
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub ")?.split(':').next())
        .map(str::to_string)
        .filter(|f| f != "listen" && f != "metrics_listen")
        .collect();
    fields.sort();
    assert_eq!(ours, fields);
}

/// What a pod's container runs: its command line with the pod's environment, and its
/// volumes as directories.
struct Pod {
    command: Vec<String>,
    env: BTreeMap<String, String>,
}

impl Pod {
    /// The pod of `workload` (a StatefulSet or DaemonSet) named `name` at `ip`, its
    /// volumes materialised under `dir`. `hosts` maps the DNS names it may use to the
    /// addresses of the pods they name.
    fn new(
        docs: &[Value],
        workload: &Value,
        name: &str,
        ip: &str,
        dir: &Path,
        hosts: &[(String, String)],
    ) -> Pod {
        let spec = &workload["spec"]["template"]["spec"];
        let container = &spec["containers"][0];
        let on_pod = |text: &str| rehost(&text.replace("0.0.0.0", ip), hosts);
        let mut mounts: Vec<(String, PathBuf)> = Vec::new();
        for mount in container["volumeMounts"].as_array().expect("volume mounts") {
            let vname = mount["name"].as_str().unwrap();
            let local = dir.join(vname);
            std::fs::create_dir_all(&local).expect("a volume directory");
            let volume = spec["volumes"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|v| v["name"] == vname);
            let files: Vec<(String, String)> = match volume {
                // The data volume claimed by the StatefulSet: empty at first.
                None => Vec::new(),
                Some(v) if v["configMap"].is_object() => {
                    let cm = find(docs, "ConfigMap", v["configMap"]["name"].as_str().unwrap());
                    entries(&cm["data"], &v["configMap"]["items"], &on_pod)
                }
                Some(v) if v["secret"].is_object() => {
                    let secret = find(docs, "Secret", v["secret"]["secretName"].as_str().unwrap());
                    entries(&secret["data"], &v["secret"]["items"], &|s: &str| {
                        s.to_string()
                    })
                }
                Some(v) => {
                    assert!(v["emptyDir"].is_object(), "an unexpected volume: {v}");
                    Vec::new()
                }
            };
            for (file, text) in files {
                let path = local.join(file);
                std::fs::write(&path, text).expect("a volume's file");
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                    .expect("chmod");
            }
            let local = match mount["subPath"].as_str() {
                Some(sub) => local.join(sub),
                None => local,
            };
            mounts.push((mount["mountPath"].as_str().unwrap().to_string(), local));
        }
        // Longest mount paths first, so that none is replaced inside another.
        mounts.sort_by_key(|(path, _)| std::cmp::Reverse(path.len()));
        let mut env = BTreeMap::new();
        for var in container["env"].as_array().expect("env") {
            let value = match var["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                Some("metadata.name") | Some("spec.nodeName") => name.to_string(),
                Some("status.podIP") | Some("status.hostIP") => ip.to_string(),
                Some(other) => panic!("an unexpected field reference {other}"),
                None => var["value"].as_str().expect("a value").to_string(),
            };
            env.insert(var["name"].as_str().unwrap().to_string(), value);
        }
        let command = container["command"]
            .as_array()
            .into_iter()
            .chain(container["args"].as_array())
            .flatten()
            .map(|word| {
                // Paths onto the volumes first: this build's own path may lie under a
                // mount point (a checkout in /tmp).
                let mut word = rebase(&on_pod(word.as_str().expect("a string")), &mounts);
                word = word.replace("/usr/local/bin/warmpath", warmpath_bin().to_str().unwrap());
                // Kubernetes expands $(VAR) in a container's command and args.
                for (k, v) in &env {
                    word = word.replace(&format!("$({k})"), v);
                }
                word
            })
            .collect();
        Pod { command, env }
    }

    fn start(&self) -> Proc {
        let mut command = Command::new(&self.command[0]);
        command.args(&self.command[1..]).envs(&self.env);
        Proc::try_spawn(&mut command, 1, "warn")
            .unwrap_or_else(|e| panic!("{:?}: {e}", self.command))
    }
}

/// `text` with each `NAME:PORT` of `hosts` (a DNS name or compose service name, where a
/// host name starts and a port follows) replaced by the address standing in for it.
pub(crate) fn rehost(text: &str, hosts: &[(String, String)]) -> String {
    let mut out = text.to_string();
    for (name, addr) in hosts {
        let pattern = format!("{name}:");
        let mut done = String::new();
        let mut rest = out.as_str();
        while let Some(i) = rest.find(&pattern) {
            let before = rest[..i].chars().last().or(done.chars().last());
            let after = rest[i + pattern.len()..].chars().next();
            let starts = before.is_none_or(|c| !(c.is_ascii_alphanumeric() || "-._".contains(c)));
            let port = after.is_some_and(|c| c.is_ascii_digit());
            done.push_str(&rest[..i]);
            if starts && port {
                done.push_str(addr);
                done.push(':');
            } else {
                done.push_str(&pattern);
            }
            rest = &rest[i + pattern.len()..];
        }
        done.push_str(rest);
        out = done;
    }
    out
}

/// `text` with every path under a mount point moved under its local directory, in one
/// pass (a local directory may itself lie under another mount point, such as `/tmp`).
/// `mounts` come longest first; a mount point counts where a path starts (after a space,
/// `=` or a quote) and ends (at `/`, a space, a quote, `;`, `,` or the end).
pub(crate) fn rebase(text: &str, mounts: &[(String, PathBuf)]) -> String {
    let mut out = String::new();
    let mut rest = text;
    'scan: while let Some(c) = rest.chars().next() {
        let starts = out.is_empty() || out.ends_with([' ', '=', '"', '\'', '\n']);
        if starts {
            for (path, local) in mounts {
                if let Some(after) = rest.strip_prefix(path.as_str()) {
                    if after.is_empty() || after.starts_with(['/', ' ', '"', '\'', '\n', ';', ','])
                    {
                        out.push_str(local.to_str().expect("a utf-8 path"));
                        rest = after;
                        continue 'scan;
                    }
                }
            }
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// The files a ConfigMap's or Secret's volume holds: every key, or the listed items.
fn entries(data: &Value, items: &Value, edit: &dyn Fn(&str) -> String) -> Vec<(String, String)> {
    let text = |key: &str| edit(data[key].as_str().unwrap_or_else(|| panic!("no key {key}")));
    match items.as_array() {
        Some(items) => items
            .iter()
            .map(|i| {
                let key = i["key"].as_str().unwrap();
                (i["path"].as_str().unwrap().to_string(), text(key))
            })
            .collect(),
        None => data
            .as_object()
            .expect("data")
            .keys()
            .map(|k| (k.clone(), text(k)))
            .collect(),
    }
}

#[test]
fn the_charts_pods_run_as_rendered_and_form_a_cluster() {
    let engine = crate::engine_sim("1000", &[]);
    let port = || free_addr().port();
    let (http, metrics, admin, gossip) = (port(), port(), port(), port());
    let (blocks, agent_metrics, residency) = (port(), port(), port());
    // The agent's headless Service stands for "localhost": the routers resolve it, as
    // they do in a cluster, and follow the agent at the address found.
    let agent_ip = "127.0.0.1";
    // Four routers: the first three vote, the fourth joins as a learner. The pool names no
    // agents: it gets the chart's default, every agent of the DaemonSet.
    let values = json!({
        "router": {
            "replicas": 4,
            "ports": {"http": http, "metrics": metrics, "admin": admin, "gossip": gossip},
            "pools": [{"model": "sim-llama", "instances": [engine.url]}],
        },
        "agent": {"ports": {"blocks": blocks, "metrics": agent_metrics, "residency": residency}},
    });
    let docs = documents(&render(&values).expect("the chart renders"));
    let dir = scratch_dir("helm-pods");
    let router_ip = |i: usize| format!("127.0.0.{}", 10 + i);
    let mut hosts: Vec<(String, String)> = (0..4)
        .map(|i| {
            let host =
                format!("wp-warmpath-router-{i}.wp-warmpath-peers.{NAMESPACE}.svc.cluster.local");
            (host, router_ip(i))
        })
        .collect();
    let agents = format!("wp-warmpath-agents.{NAMESPACE}.svc.cluster.local");
    assert!(
        router_config(&docs).contains(&format!("dns:agent@{agents}:{residency}")),
        "{}",
        router_config(&docs)
    );
    hosts.push((agents, "localhost".to_string()));
    let agent = Pod::new(
        &docs,
        find(&docs, "DaemonSet", "wp-warmpath-agent"),
        "gpu-node-1",
        agent_ip,
        &dir.join("agent"),
        &hosts,
    )
    .start();
    let statefulset = find(&docs, "StatefulSet", "wp-warmpath-router");
    let routers: Vec<Proc> = (0..4)
        .map(|i| {
            let name = format!("wp-warmpath-router-{i}");
            Pod::new(
                &docs,
                statefulset,
                &name,
                &router_ip(i),
                &dir.join(&name),
                &hosts,
            )
            .start()
        })
        .collect();
    let token = find(&docs, "Secret", "wp-warmpath-router-secrets")["data"]["admin.token"]
        .as_str()
        .expect("the chart's admin token")
        .to_string();
    assert!(token.len() >= 32, "a random token: {token:?}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // Raft: ids 1-3 vote (ordinal + 1), 4 is a learner; every router names the leader.
        let admin_url = |i: usize| format!("http://{}:{admin}", router_ip(i));
        let status = until(
            Duration::from_secs(60),
            "a Raft cluster of 3 voters and a learner, every router naming the leader",
            || async {
                let all: Vec<Value> = (0..4)
                    .filter_map(|i| crate::cluster_status(&admin_url(i), &token))
                    .collect();
                let agreed = all.len() == 4
                    && all.iter().all(|c| {
                        c["raft"]["leader"].is_u64()
                            && c["raft"]["leader"] == all[0]["raft"]["leader"]
                            && c["raft"]["members"].as_object().map(|m| m.len()) == Some(3)
                            && c["raft"]["learners"]
                                .as_object()
                                .is_some_and(|l| l.contains_key("4"))
                    });
                agreed.then(|| all[3].clone())
            },
        )
        .await;
        assert_eq!(status["raft"]["node_id"], 4, "{status}");
        // A request through the learner, with the config the chart seeded (default tenant,
        // the pool): gossip and routing work on the pod addresses.
        let learner = format!("http://{}:{http}", router_ip(3));
        let reply = crate::router::post(
            &crate::router::client(),
            &learner,
            "/v1/completions",
            crate::router::completion("hello from a pod", 8, false),
            &[],
        )
        .await;
        assert_eq!(
            reply.status,
            200,
            "{:?}",
            String::from_utf8_lossy(&reply.body)
        );
        // Every router follows the agent over QUIC with the chart's CA and certificates.
        let agent_metrics_url = format!("http://{agent_ip}:{agent_metrics}/metrics");
        until(
            Duration::from_secs(30),
            "4 residency subscribers on the agent",
            || async {
                let text = crate::router::get_text(&agent_metrics_url).await;
                let n = crate::router::metric(&text, "warmpath_agent_residency_subscribers");
                (n == 4.0).then_some(())
            },
        )
        .await;
    });
    drop((routers, agent, engine));
}
