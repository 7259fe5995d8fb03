//! The README's commands: every `warmpath` command line it shows (as `warmpath …` or
//! `cargo run --release --bin warmpath -- …`) names subcommands that exist and flags their
//! `--help` lists, so that a newcomer who copies one gets the program, not a usage error.

use std::collections::BTreeSet;

/// The command lines of the README's `sh` blocks, continuation lines joined and comments
/// dropped.
fn shell_lines(readme: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut in_sh = false;
    let mut pending = String::new();
    for line in readme.lines() {
        if line.starts_with("```") {
            in_sh = !in_sh && line.trim() == "```sh";
            continue;
        }
        if !in_sh {
            continue;
        }
        let code = line.split(" #").next().unwrap_or("").trim_end();
        match code.strip_suffix('\\') {
            Some(more) => pending.push_str(more),
            None => {
                pending.push_str(code);
                lines.push(std::mem::take(&mut pending));
            }
        }
    }
    lines
}

/// The words after `warmpath` (or after `cargo run --release --bin warmpath --`), if the
/// line runs it.
fn warmpath_words(line: &str) -> Option<Vec<&str>> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = match words.first() {
        Some(&"warmpath") => 1,
        _ => {
            let run = words.windows(2).position(|w| w == ["cargo", "run"])?;
            run + words[run..].iter().position(|w| *w == "--")? + 1
        }
    };
    Some(words[at..].to_vec()).filter(|w| !w.is_empty())
}

/// `warmpath PATH --help`, if PATH is a subcommand path.
fn help(path: &[&str]) -> Option<String> {
    let mut args = path.to_vec();
    args.push("--help");
    let out = crate::warmpath(&args);
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn every_command_the_readme_shows_parses() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("README.md");
    let mut checked = 0;
    for line in shell_lines(&readme) {
        let Some(words) = warmpath_words(&line) else {
            continue;
        };
        // The workspace builds two binaries (warmpath, warmpath-jepsen): a `cargo run`
        // that does not name one is refused by cargo before anything runs.
        if line.contains("cargo run") {
            assert!(
                line.contains("--bin warmpath "),
                "README: `cargo run` must name `--bin warmpath`: {line}"
            );
        }
        let sub = words[0];
        let mut texts = vec![help(&[sub])
            .unwrap_or_else(|| panic!("README: `warmpath {sub}` is no subcommand: {line}"))];
        // Nested subcommands (`admin tenants put`): each word that extends the path.
        let mut path = vec![sub];
        for w in words[1..].iter().filter(|w| !w.starts_with('-')) {
            path.push(w);
            match help(&path) {
                Some(t) => texts.push(t),
                None => {
                    path.pop();
                }
            }
        }
        let flags: BTreeSet<&str> = words
            .iter()
            .filter(|w| w.starts_with("--"))
            .map(|w| w.split('=').next().unwrap_or(w))
            .collect();
        for flag in flags {
            let named = texts.iter().any(|t| {
                t.match_indices(flag).any(|(i, _)| {
                    let after = t[i + flag.len()..].chars().next();
                    !after.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-')
                })
            });
            assert!(
                named,
                "README: `warmpath {}` has no flag {flag}: {line}",
                path.join(" ")
            );
        }
        checked += 1;
    }
    assert!(
        checked >= 10,
        "only {checked} warmpath commands found in the README"
    );
}
