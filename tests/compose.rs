//! `deploy/compose`: the distribution's docker-compose accepts the file, and its services
//! run as written. No Docker daemon runs here, so each service runs as a process: its
//! command line and environment from `docker-compose config`, its volumes as
//! directories, and its own network as a loopback address of its own (127.0.0.N), standing
//! in for the container's address, a wildcard bind and its service name.

use crate::deploy::{
    assert_real_flags, deploy_dir, query, start_prometheus, succeeds, value, Stopped,
};
use crate::helm::{documents, rebase, rehost};
use crate::{scratch_dir, until, warmpath_bin, Proc};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// `docker-compose config` of deploy/compose: the services as Compose resolves them.
fn resolved() -> Value {
    let out = Command::new(warmpath_testkit::system_tool("docker-compose"))
        .arg("-f")
        .arg(deploy_dir().join("compose/compose.yaml"))
        .arg("config")
        .output()
        .expect("docker-compose runs");
    assert!(
        out.status.success(),
        "docker-compose config: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    documents(&String::from_utf8_lossy(&out.stdout)).remove(0)
}

/// Whether `service` runs the warmpath image.
fn is_warmpath(service: &Value) -> bool {
    service["image"]
        .as_str()
        .is_some_and(|i| i.contains("warmpath"))
}

/// docker-compose accepts the file; every warmpath command in it passes only flags the
/// binary takes; Prometheus's config passes `promtool check config` with the rules it
/// loads; Grafana is provisioned with the dashboard of deploy/grafana.
#[test]
fn the_compose_file_is_valid_and_passes_real_flags() {
    let config = resolved();
    let services = config["services"].as_object().expect("services");
    let mut commands = 0;
    for (name, service) in services.iter().filter(|(_, s)| is_warmpath(s)) {
        let words: Vec<&str> = service["command"]
            .as_array()
            .expect("a command")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        // A start script (`sh -ec "... exec warmpath SUBCOMMAND ..."`) or the arguments.
        let line = if service["entrypoint"][0] == "/bin/sh" {
            words[0].to_string()
        } else {
            format!("warmpath {}", words.join(" "))
        };
        for run in line.split("warmpath ").skip(1) {
            let command = run.split_whitespace().next().expect("a subcommand");
            if run.contains("--") {
                assert_real_flags(&format!("compose service {name}"), command, run);
                commands += 1;
            }
        }
    }
    // init, 3 engines, 2 agents, 3 routers, and the LMCache host's agent.
    assert_eq!(commands, 10, "{services:?}");
    // The vLLM + LMCache engine (profile lmcache) reaches its agent's HyperPod API on the
    // loopback of the network namespace it shares, and its segment in the IPC namespace
    // it shares, as docs/lmcache.md says; the agent's own flags are checked above.
    let agent = &services["agent-lmcache"];
    let vllm = &services["vllm-lmcache"];
    for s in [agent, vllm] {
        assert_eq!(s["profiles"], serde_json::json!(["lmcache"]), "{s}");
    }
    assert_eq!(agent["ipc"], "shareable");
    assert_eq!(vllm["network_mode"], "service:agent-lmcache");
    assert_eq!(vllm["ipc"], "service:agent-lmcache");
    let words: Vec<&str> = agent["command"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let flag = |name: &str| {
        let at = words.iter().position(|w| *w == name).expect(name);
        words[at + 1]
    };
    assert_eq!(flag("--hyperpod-listen"), "127.0.0.1:9200");
    let env = &vllm["environment"];
    assert_eq!(
        env["LMCACHE_REMOTE_URL"],
        "sagemaker-hyperpod://127.0.0.1:9200"
    );
    assert_eq!(env["LMCACHE_CHUNK_SIZE"], "256");
    assert_eq!(env["LMCACHE_ENABLE_KV_EVENTS"], "true");
    let extra: Value = serde_json::from_str(env["LMCACHE_EXTRA_CONFIG"].as_str().unwrap()).unwrap();
    assert_eq!(
        extra["sagemaker_hyperpod_shared_memory_name"],
        flag("--hyperpod-shm-name")
    );
    assert!(
        flag("--kv-events").ends_with("=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558"),
        "the agent follows the engine's KV events on their shared loopback"
    );
    let dir = scratch_dir("compose-promtool");
    let prometheus = std::fs::read_to_string(deploy_dir().join("compose/prometheus.yml"))
        .expect("prometheus.yml");
    let mounted = "/etc/prometheus/rules.yml";
    assert!(prometheus.contains(mounted));
    let rules = deploy_dir().join("prometheus/rules.yml");
    let here = dir.join("prometheus.yml");
    std::fs::write(&here, prometheus.replace(mounted, rules.to_str().unwrap())).unwrap();
    succeeds("promtool", &["check", "config", here.to_str().unwrap()]);
    let provider = std::fs::read_to_string(
        deploy_dir().join("compose/grafana/provisioning/dashboards/warmpath.yml"),
    )
    .expect("the dashboard provider");
    // docker-compose 1.x writes a volume as SOURCE:TARGET[:MODE].
    let grafana = services["grafana"]["volumes"].as_array().expect("volumes");
    let target = grafana
        .iter()
        .filter_map(Value::as_str)
        .find_map(|v| {
            let mut parts = v.split(':');
            let source = parts.next()?;
            source.ends_with("deploy/grafana").then(|| parts.next())?
        })
        .expect("deploy/grafana mounted into Grafana");
    assert!(provider.contains(&format!("path: {target}")), "{provider}");
}

/// The command line a service's container runs, as this machine runs it: `$$` unescaped,
/// its address for `$(hostname -i)` and wildcard binds, service names rehosted, and
/// paths moved onto its volumes' directories.
fn command_line(
    service: &Value,
    ip: &str,
    hosts: &[(String, String)],
    mounts: &[(String, PathBuf)],
) -> Vec<String> {
    let mut words: Vec<String> = Vec::new();
    match service["entrypoint"].as_array() {
        Some(e) => words.extend(e.iter().filter_map(Value::as_str).map(str::to_string)),
        // The image's ENTRYPOINT (Dockerfile).
        None if is_warmpath(service) => words.push("/usr/local/bin/warmpath".into()),
        None => {}
    }
    words.extend(
        service["command"]
            .as_array()
            .expect("a command")
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_string),
    );
    words
        .into_iter()
        .map(|w| {
            let w = w
                .replace("$$", "$")
                .replace("$(hostname -i)", ip)
                .replace("0.0.0.0", ip);
            let w = rebase(&rehost(&w, hosts), mounts);
            match w.as_str() {
                "/usr/local/bin/warmpath" => warmpath_bin().to_string_lossy().into_owned(),
                _ => w,
            }
        })
        .collect()
}

/// The services' volumes as directories under `dir`: the named ones shared, a service's
/// own state its own, a bind-mounted file copied with the services' names rehosted and
/// its wildcard binds on the service's address.
fn mounts(
    service: &Value,
    name: &str,
    ip: &str,
    dir: &Path,
    hosts: &[(String, String)],
) -> Vec<(String, PathBuf)> {
    let mut mounts = Vec::new();
    for volume in service["volumes"].as_array().into_iter().flatten() {
        let mut parts = volume.as_str().expect("SOURCE:TARGET").split(':');
        let (source, target) = (parts.next().unwrap(), parts.next().unwrap());
        let local = if source.starts_with('/') {
            let text = std::fs::read_to_string(source).expect("a bind-mounted file");
            let path = dir.join(name).join(Path::new(source).file_name().unwrap());
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, rehost(&text, hosts).replace("0.0.0.0", ip)).unwrap();
            path
        } else if source == "secrets" {
            dir.join("secrets")
        } else {
            dir.join(name).join(source)
        };
        if !source.starts_with('/') {
            std::fs::create_dir_all(&local).unwrap();
        }
        mounts.push((target.to_string(), local));
    }
    mounts.sort_by_key(|(path, _)| std::cmp::Reverse(path.len()));
    mounts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compose_services_run_as_written_and_prometheus_scrapes_them() {
    let config = resolved();
    let services = config["services"].as_object().expect("services");
    let dir = scratch_dir("compose-run");
    // A loopback address per service, for its name.
    let mut hosts: Vec<(String, String)> = services
        .keys()
        .enumerate()
        .map(|(i, name)| (name.clone(), format!("127.0.0.{}", 70 + i)))
        .collect();
    // Longest names first, so that none is replaced inside another.
    hosts.sort_by_key(|(name, _)| std::cmp::Reverse(name.len()));
    let ip = |name: &str| hosts.iter().find(|(n, _)| n == name).unwrap().1.clone();
    let prepare = |name: &str| {
        let service = &services[name];
        let environment: BTreeMap<String, String> = service["environment"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
            .collect();
        let mounts = mounts(service, name, &ip(name), &dir, &hosts);
        let words = command_line(service, &ip(name), &hosts, &mounts);
        let mut command = Command::new(&words[0]);
        // Start scripts call `warmpath` from the image's PATH: this build's, here.
        let bin = warmpath_bin().parent().expect("a directory").to_owned();
        let path = std::env::var("PATH").unwrap_or_default();
        command
            .args(&words[1..])
            .envs(environment)
            .env("PATH", format!("{}:{path}", bin.display()));
        command
    };
    // init makes the secrets; chown needs root (in a container it is).
    let mut init = prepare("init");
    let root = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").unwrap()) == 0;
    if !root {
        let args: Vec<String> = init
            .get_args()
            .map(|a| a.to_string_lossy().replace("chown -R 65532:65532", "true"))
            .collect();
        let envs: Vec<_> = init
            .get_envs()
            .filter_map(|(k, v)| Some((k.to_owned(), v?.to_owned())))
            .collect();
        init = Command::new("/bin/sh");
        init.args(&args).envs(envs);
    }
    let out = init.output().expect("init runs");
    assert!(
        out.status.success(),
        "init {:?}: {}",
        init.get_args().collect::<Vec<_>>(),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(dir.join("secrets/tls/agent.key").exists());
    // Redis, as the compose file starts it, on the service's address.
    let mut redis = prepare("redis");
    redis
        .args(["--bind", &ip("redis"), "--port", "6379"])
        .stdout(Stdio::null());
    let _redis = Stopped(redis.spawn().expect("redis-server runs"));
    let mut running: Vec<Proc> = Vec::new();
    for name in ["agent-1", "agent-2", "engine-1", "engine-2", "engine-3"] {
        running.push(
            Proc::try_spawn(&mut prepare(name), 1, "warn")
                .unwrap_or_else(|e| panic!("{name}: {e}")),
        );
    }
    for name in ["router-1", "router-2", "router-3"] {
        running.push(
            Proc::try_spawn(&mut prepare(name), 1, "warn")
                .unwrap_or_else(|e| panic!("{name}: {e}")),
        );
    }
    let token = std::fs::read_to_string(dir.join("secrets/admin.token")).expect("the admin token");
    // Raft: three voters and a leader, seen from router-1.
    let admin = format!("http://{}:7000", ip("router-1"));
    until(
        Duration::from_secs(60),
        "a Raft leader among the 3 routers",
        || async {
            let v = crate::cluster_status(&admin, &token)?;
            (v["raft"]["leader"].is_u64() && v["raft"]["members"].as_object()?.len() == 3)
                .then_some(())
        },
    )
    .await;
    // Each router ready (it has heard the leader and follows the configuration), as a
    // load balancer would wait for it.
    for n in 1..=3 {
        let url = format!("http://{}:8080/readyz", ip(&format!("router-{n}")));
        until(
            Duration::from_secs(30),
            &format!("router-{n} ready"),
            || {
                let url = url.clone();
                async move { (crate::router::get_status(&url).await == Some(200)).then_some(()) }
            },
        )
        .await;
    }
    let http = crate::router::client();
    // Traffic through each router in turn, all answered: 3 requests per call.
    let prefix =
        "You are a support bot for warmpath, a gateway that routes prompts to warm caches. "
            .repeat(12);
    let mut sent = 0;
    let mut traffic = || {
        let batch: Vec<(String, String)> = (0..3)
            .map(|_| {
                sent += 1;
                let router = format!("http://{}:8080", ip(&format!("router-{}", 1 + sent % 3)));
                (router, format!("{prefix}Ticket {sent}: hello"))
            })
            .collect();
        let http = http.clone();
        async move {
            for (router, prompt) in batch {
                let body = crate::router::completion(&prompt, 4, false);
                let r = crate::router::post(&http, &router, "/v1/completions", body, &[]).await;
                assert_eq!(
                    r.status,
                    200,
                    "{router}: {:?}",
                    String::from_utf8_lossy(&r.body)
                );
            }
        }
    };
    for _ in 0..4 {
        traffic().await;
    }
    // Prometheus with the compose file's configuration: every process up, and the rules
    // record.
    let prometheus = std::fs::read_to_string(deploy_dir().join("compose/prometheus.yml")).unwrap();
    let rules = deploy_dir().join("prometheus/rules.yml");
    let prometheus =
        rehost(&prometheus, &hosts).replace("/etc/prometheus/rules.yml", rules.to_str().unwrap());
    let (_prometheus, prom) = start_prometheus(&dir, &prometheus);
    let mut last = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..90 {
        // Counters must move while Prometheus watches for a rate to be above 0.
        traffic().await;
        let up = query(&prom, "up").await;
        let requests = query(&prom, "warmpath:router_requests:rate1m").await;
        let subscribers = query(&prom, "warmpath_agent_residency_subscribers").await;
        let observed = query(&prom, "warmpath_index_holders{source=\"observed\"}").await;
        let done = up.len() == 8
            && up.iter().all(|s| value(s) == 1.0)
            && requests.iter().any(|s| value(s) > 0.0)
            && subscribers.len() == 2
            && subscribers.iter().all(|s| value(s) == 3.0)
            && observed.iter().any(|s| value(s) > 0.0);
        last = (up, requests, subscribers, observed);
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let (up, requests, subscribers, observed) = last;
    assert_eq!(
        up.len(),
        8,
        "3 routers, 2 agents, 3 engines scraped: {up:?}"
    );
    assert!(up.iter().all(|s| value(s) == 1.0), "{up:?}");
    assert!(
        requests.iter().any(|s| value(s) > 0.0),
        "the rules record: {requests:?}"
    );
    // Every router follows both agents over mutual TLS with the certificates init made.
    assert!(
        subscribers.len() == 2 && subscribers.iter().all(|s| value(s) == 3.0),
        "{subscribers:?}"
    );
    // ... and learns from them what the engines' caches hold: each engine publishes its
    // KV events to its host's agent, which reports them to every router.
    assert!(
        observed.iter().any(|s| value(s) > 0.0),
        "observed index holders: {observed:?}"
    );
    drop(running);
}
