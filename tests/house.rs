//! The house rules the code keeps: no module of a crate imports a module that imports it
//! back (`tests/tools/import_circles.py` reads every crate of the workspace).

use std::process::Command;

#[test]
fn no_module_imports_a_module_that_imports_it_back() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = warmpath_testkit::system_tool("python3");
    let out = Command::new(python)
        .arg(root.join("tests/tools/import_circles.py"))
        .arg(&root)
        .output()
        .expect("run tests/tools/import_circles.py");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "import circles found:\n{report}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(report.contains("import circles: 0"), "{report}");
}
