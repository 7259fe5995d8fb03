//! The system commands the tests run (redis-server, unshare, …): found on `PATH`, or a
//! panic that names the Debian package and the command that installs it.

use std::path::PathBuf;

/// The commands the tests run that a fresh machine may lack, and their Debian packages:
/// `tests/tools/packages.txt`, which `tests/run` installs from.
const PACKAGES: &str = include_str!("../../tests/tools/packages.txt");

/// The Debian package that provides `tool` (a command or an absolute path), from
/// `tests/tools/packages.txt`.
pub fn package_of(tool: &str) -> Option<&'static str> {
    PACKAGES
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once(char::is_whitespace))
        .find(|(t, _)| *t == tool)
        .map(|(_, p)| p.trim())
}

/// `tool`, found on `PATH` (or at its absolute path); panics naming its package and the
/// command that installs it when it is missing, so that no test passes by skipping. A
/// search by hand: six lines where a crate (`which`) would add a dependency for one call.
pub fn system_tool(tool: &str) -> PathBuf {
    let found = if tool.starts_with('/') {
        Some(PathBuf::from(tool)).filter(|p| p.exists())
    } else {
        std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join(tool))
                .find(|p| p.is_file())
        })
    };
    found.unwrap_or_else(|| {
        let package = package_of(tool).unwrap_or("(not in tests/tools/packages.txt)");
        panic!(
            "`{tool}` is missing (Debian package {package}): run tests/run, which installs \
             what the tests need, or: sudo apt-get install -y {package}"
        )
    })
}
