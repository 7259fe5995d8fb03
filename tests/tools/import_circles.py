#!/usr/bin/env python3
"""Import circles between the modules of one crate.

Usage: python3 tests/tools/import_circles.py [WORKSPACE_ROOT]   (default: the current folder)

For every package in the workspace's `members` list and every target root it has
(src/lib.rs, src/main.rs, src/bin/*.rs, tests/*.rs, benches/*.rs, examples/*.rs), it
follows the `mod NAME;` declarations to find each module's file, and treats an inline
`mod NAME { ... }` (a test module, say) as a module of its own. In each module it reads
the paths that name another module of the same crate: `use crate::…`, `use super::…`,
`use self::…`, `use child::…` (braced groups expanded) and the same paths written inline
in code (`super::leader_write(…)`, `crate::metric_names::X`, `child::f(…)`). A path counts for the longest
module it names (`crate::a::b::Item` is module `a::b` when that is a module, else `a`).

A module depends on another when one of its paths names it; a module does not depend on
its own submodules by declaring them (`mod x;`), nor on itself. Comments, strings and
character literals are skipped; `#[cfg]` is ignored, so test-only paths count too; macro
bodies are read as code; `#[path]` attributes are not followed. A path through a name
that the module it reaches imported from another crate (`crate::check` where the binary's
root says `use warmpath_jepsen::check`) names that crate, not the module.

It prints, per crate target, each circle (a strongly connected set of two or more
modules) with one cycle through it and, for each step, the file:line of a path that makes
it; then a total line `import circles: N`. It exits 0 when there are none and 1 otherwise,
so a test or CI step can call it.
"""

import os
import re
import sys

try:
    import tomllib
except ImportError:  # Python < 3.11: the members list is simple enough to read by hand.
    tomllib = None


def workspace_members(root):
    text = open(os.path.join(root, "Cargo.toml"), encoding="utf-8").read()
    if tomllib:
        return tomllib.loads(text)["workspace"]["members"]
    m = re.search(r"members\s*=\s*\[(.*?)\]", text, re.S)
    return re.findall(r'"([^"]+)"', m.group(1)) if m else []


def target_roots(pkg_dir):
    roots = []
    for rel in ("src/lib.rs", "src/main.rs"):
        p = os.path.join(pkg_dir, rel)
        if os.path.isfile(p):
            roots.append(p)
    for sub in ("src/bin", "tests", "benches", "examples"):
        d = os.path.join(pkg_dir, sub)
        if not os.path.isdir(d):
            continue
        for name in sorted(os.listdir(d)):
            p = os.path.join(d, name)
            if name.endswith(".rs") and os.path.isfile(p):
                roots.append(p)
            elif os.path.isfile(os.path.join(p, "main.rs")):
                roots.append(os.path.join(p, "main.rs"))
    return roots


TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<line_comment>//[^\n]*)
  | (?P<block_comment>/\*)
  | (?P<raw_string>b?r(?P<hashes>\#*)")
  | (?P<string>b?"(?:\\.|[^"\\])*")
  | (?P<char>b?'(?:\\.|[^'\\])')
  | (?P<lifetime>'[A-Za-z_][A-Za-z0-9_]*)
  | (?P<ident>r\#[A-Za-z_][A-Za-z0-9_]*|[A-Za-z_][A-Za-z0-9_]*)
  | (?P<path_sep>::)
  | (?P<punct>.)
    """,
    re.S | re.X,
)


def tokens(text):
    """(kind, value, line) for identifiers, `::` and punctuation; nothing for comments,
    strings and literals."""
    i, line, n = 0, 1, len(text)
    while i < n:
        m = TOKEN.match(text, i)
        kind = m.lastgroup if m.lastgroup != "hashes" else "raw_string"
        if m.group("block_comment"):
            depth, j = 1, m.end()
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            end = j
        elif m.group("raw_string"):
            close = '"' + m.group("hashes")
            j = text.find(close, m.end())
            end = n if j < 0 else j + len(close)
        else:
            end = m.end()
        if kind == "ident":
            yield ("ident", m.group("ident"), line)
        elif kind == "path_sep":
            yield ("::", "::", line)
        elif kind == "punct":
            yield ("punct", m.group("punct"), line)
        line += text.count("\n", i, end)
        i = end


class Module:
    def __init__(self, path, file):
        self.path = path  # tuple of names below the crate root
        self.file = file
        self.refs = []  # (tuple path as written, line)
        self.imports = {}  # name a `use` brings in -> the path it was brought from


def parse_file(file, path, modules):
    """Reads one module file; records it and its inline modules in `modules`, and follows
    `mod x;` to the files of its submodules."""
    text = open(file, encoding="utf-8").read()
    toks = list(tokens(text))
    base = os.path.dirname(file)
    stem = os.path.splitext(os.path.basename(file))[0]
    # A non-root, non-mod.rs file `a.rs` keeps its submodules in `a/`.
    is_dir_owner = not path or stem == "mod"
    sub_dir = base if is_dir_owner else os.path.join(base, stem)
    stack = [(Module(path, file), 0)]  # (module, brace depth at which it closes)
    modules[path] = stack[0][0]
    depth = 0
    i = 0
    while i < len(toks):
        kind, val, line = toks[i]
        mod, _ = stack[-1]
        if kind == "punct" and val == "{":
            depth += 1
        elif kind == "punct" and val == "}":
            depth -= 1
            if len(stack) > 1 and depth == stack[-1][1]:
                stack.pop()
        elif kind == "ident" and val == "mod" and i + 2 < len(toks) and toks[i + 1][0] == "ident":
            name = toks[i + 1][1]
            nxt = toks[i + 2]
            child_path = mod.path + (name,)
            if nxt[1] == ";":
                rel = os.path.join(*child_path[len(path):]) if len(mod.path) > len(path) else name
                for cand in (os.path.join(sub_dir, rel + ".rs"), os.path.join(sub_dir, rel, "mod.rs")):
                    if os.path.isfile(cand):
                        parse_file(cand, child_path, modules)
                        break
                i += 3
                continue
            if nxt[1] == "{":
                child = Module(child_path, file)
                modules[child_path] = child
                stack.append((child, depth))
                depth += 1
                i += 3
                continue
        elif kind == "ident" and val == "use":
            j = i + 1
            end = j
            while end < len(toks) and toks[end][1] != ";":
                end += 1
            for p in expand_use(toks[j:end]):
                if p:
                    mod.refs.append((tuple(p), line))
                    mod.imports[p[-1]] = tuple(p)
            i = end + 1
            continue
        elif kind == "ident" and i + 1 < len(toks) and toks[i + 1][0] == "::":
            prev = toks[i - 1] if i else None
            # `$crate::` (macros) and the middle of a path are not the start of one.
            if not (prev and (prev[1] == "$" or prev[0] == "::")):
                p = [val]
                j = i + 1
                while j + 1 < len(toks) and toks[j][0] == "::" and toks[j + 1][0] == "ident":
                    p.append(toks[j + 1][1])
                    j += 2
                mod.refs.append((tuple(p), line))
                i = j
                continue
        i += 1


def expand_use(toks):
    """The paths of one use tree (`a::{b, c::{d, e}}` gives a::b, a::c::d, a::c::e)."""
    out = []

    def tree(k, prefix):
        # returns index after this tree
        cur = list(prefix)
        while k < len(toks):
            kind, val, _ = toks[k]
            if kind == "ident" and val != "as":
                cur.append(val)
                k += 1
            elif kind == "::":
                k += 1
            elif val == "*":
                k += 1
            elif val == "{":
                k += 1
                while k < len(toks) and toks[k][1] != "}":
                    k = tree(k, cur)
                    if k < len(toks) and toks[k][1] == ",":
                        k += 1
                return k + 1
            elif kind == "ident" and val == "as":
                k += 2  # skip the alias
            else:  # , or }
                break
        out.append(cur)
        return k

    k = 0
    # skip leading `::`
    while k < len(toks) and toks[k][0] == "::":
        k += 1
    tree(k, [])
    return out


def resolve(mod_path, written, modules):
    """The module of the crate that a written path names, or None."""
    p = list(written)
    if p[0] == "crate":
        cur, rest = [], p[1:]
    elif p[0] not in ("super", "self"):
        # A relative path (`network::current`, `use leader::X`) names a child module of
        # this one; anything else (an extern crate, a type, a variant) is not ours.
        if tuple(mod_path) + (p[0],) not in modules:
            return None
        cur, rest = list(mod_path), p
    else:
        cur = list(mod_path)
        rest = p
        while rest and rest[0] in ("super", "self"):
            if rest[0] == "super":
                if not cur:
                    return None
                cur.pop()
            rest = rest[1:]
    best = tuple(cur)
    for name in rest:
        cand = tuple(cur + [name])
        if cand in modules:
            cur.append(name)
            best = cand
        else:
            # `crate::check` in a binary whose root has `use warmpath_jepsen::check`: the
            # name is another crate's, only passed through; no edge to the root.
            via = modules[best].imports.get(name)
            if via and via[0] not in ("crate", "super", "self") and best + (via[0],) not in modules:
                return None
            break
    return best


def circles(modules):
    graph = {m: {} for m in modules}
    for m, mod in modules.items():
        for written, line in mod.refs:
            t = resolve(m, written, modules)
            if t is None or t == m or t not in modules:
                continue
            graph[m].setdefault(t, (mod.file, line))
    # Tarjan's strongly connected components.
    index, low, on, stack, sccs, counter = {}, {}, set(), [], [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return graph, sccs


def one_cycle(graph, comp):
    """A shortest cycle through the first module of `comp`, inside `comp`."""
    start = comp[0]
    members = set(comp)
    prev = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w not in members:
                continue
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return comp


def name(path):
    return "crate" if not path else "::".join(path)


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".")
    total = 0
    for member in workspace_members(root):
        pkg = os.path.join(root, member)
        for target in target_roots(pkg):
            modules = {}
            parse_file(target, (), modules)
            graph, sccs = circles(modules)
            for comp in sccs:
                total += 1
                rel = os.path.relpath(target, root)
                print(f"{rel}: circle among {', '.join(name(c) for c in comp)}")
                cyc = one_cycle(graph, comp)
                for a, b in zip(cyc, cyc[1:]):
                    file, line = graph[a][b]
                    print(f"    {name(a)} -> {name(b)}  ({os.path.relpath(file, root)}:{line})")
    print(f"import circles: {total}")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
