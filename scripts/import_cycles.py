#!/usr/bin/env python3
"""Print the file-level import cycles of Rust crates.

Usage: scripts/import_cycles.py [--no-tests] [CRATE_DIR ...]   (default: every crate of
the workspace, found as folders with a Cargo.toml and a src/ folder)

A file "uses" another when it names an item defined there through a path
(`use crate::a::B`, `super::B`, `self::b::C`, `b::C` for a child module `b`,
also inside function bodies). Names re-exported by a `use` are followed to
the file that defines them, so `pub use plan::ShardPlan;` in a mod.rs does
not make its children depend on the mod.rs; `crate::m` for a
`#[macro_export]` macro names the file that defines the macro. `mod x;` declarations are not
uses. Comments and string literals are ignored.

Prints each cycle (a strongly connected group of files, with one
`file:line` per edge) and exits 1 when there is one, 0 otherwise.

`--no-tests` leaves out test code: inline `mod tests { .. }` blocks and
files whose module is named `tests`.
"""

import os
import re
import sys

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_code(text):
    """The text with comments, strings and char literals blanked (lines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
            continue
        if text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * text.count("\n", i, j))
            i = j
            continue
        m = re.match(r'b?r(#*)"', text[i:i + 12]) if c in "br" else None
        if m and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = '"' + m.group(1)
            j = text.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
            continue
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
            continue
        if c == "'":
            m = re.match(r"'(\\.[^']*|[^\\'])'", text[i:i + 12])
            if m:
                out.append("' '")
                i += m.end()
                continue
        out.append(c)
        i += 1
    return "".join(out)


def expand_use_tree(tree):
    """`a::{b, c::{d, e as f}}` -> [(['a','b'], 'b'), (['a','c','d'], 'd'), (['a','c','e'], 'f')]."""
    tree = re.sub(r"\s+as\s+", "@", tree)
    tree = re.sub(r"\s+", "", tree)
    results = []

    def split_top(s):
        parts, depth, cur = [], 0, ""
        for ch in s:
            depth += (ch == "{") - (ch == "}")
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        return parts + [cur] if cur else parts

    def walk(prefix, s):
        if not s:
            return
        brace = s.find("{")
        if brace >= 0 and s.endswith("}"):
            head = [x for x in s[:brace].split("::") if x]
            for part in split_top(s[brace + 1:-1]):
                walk(prefix + head, part)
            return
        s, _, alias = s.partition("@")
        segs = [x for x in s.split("::") if x]
        if segs == ["self"]:
            segs = []
        path = prefix + segs
        results.append((path, alias or (path[-1] if path else None)))

    walk([], tree)
    return results


class Crate:
    def __init__(self, root, no_tests=False):
        self.root = root
        self.no_tests = no_tests
        self.src = os.path.join(root, "src")
        self.files = {}  # module path tuple -> file
        self.text = {}  # file -> stripped text
        for dirpath, _, names in os.walk(self.src):
            for name in names:
                if not name.endswith(".rs"):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, self.src)[:-3].split(os.sep)
                if rel in (["lib"], ["main"]):
                    mod = ()
                elif rel[-1] == "mod":
                    mod = tuple(rel[:-1])
                else:
                    mod = tuple(rel)
                if mod in self.files and rel in (["main"],):
                    continue
                if len(rel) > 1 and rel[0] == "bin":
                    continue
                self.files[mod] = path
                with open(path, encoding="utf-8") as f:
                    self.text[path] = strip_code(f.read())
        self.mods = {v: k for k, v in self.files.items()}
        self.imports = {f: self._imports(f) for f in self.text}
        # `#[macro_export]` macros live at the crate root wherever they are
        # written: `crate::m!` names the file that defines `m`.
        self.macro_exports = {}
        for path, text in self.text.items():
            for m in re.finditer(r"#\[macro_export\]\s*macro_rules!\s*(" + IDENT + r")", text):
                self.macro_exports.setdefault(m.group(1), path)

    def children(self, mod):
        return {m[-1] for m in self.files if len(m) == len(mod) + 1 and m[:-1] == mod}

    def absolute(self, mod, segs):
        """Resolve a path written in module `mod` to absolute segments."""
        if not segs:
            return None
        if segs[0] == "crate":
            return list(segs[1:])
        if segs[0] in ("self", "super"):
            base = list(mod)
            i = 0
            while i < len(segs) and segs[i] in ("self", "super"):
                if segs[i] == "super":
                    if not base:
                        return None
                    base.pop()
                i += 1
            return base + list(segs[i:])
        if segs[0] in self.children(mod):
            return list(mod) + list(segs)
        return None

    def _imports(self, path):
        """name -> absolute path for each `use` of a crate path in the file."""
        mod = self.mods[path]
        out = {}
        for m in re.finditer(r"\buse\s+([^;]+);", self.text[path]):
            for segs, name in expand_use_tree(m.group(1)):
                if not segs:
                    continue
                if segs[-1] == "*":
                    a = self.absolute(mod, segs[:-1])
                    if a is not None:
                        out.setdefault("*", []).append(a)
                    continue
                a = self.absolute(mod, segs)
                if name:
                    # None: a name from another crate (no edge inside this one).
                    out[name] = a
        return out

    def resolve(self, segs, seen=None):
        """The file defining the item at absolute `segs` (following re-exports)."""
        seen = seen or set()
        for k in range(len(segs), -1, -1):
            mod = tuple(segs[:k])
            if mod not in self.files:
                continue
            path = self.files[mod]
            rest = segs[k:]
            if not rest:
                return path
            if not mod and rest[0] in self.macro_exports:
                return self.macro_exports[rest[0]]
            key = (path, rest[0])
            if key in seen:
                return path
            seen.add(key)
            imp = self.imports[path]
            if rest[0] in imp:
                if imp[rest[0]] is None:
                    return None
                return self.resolve(imp[rest[0]] + rest[1:], seen)
            if re.search(r"\b(fn|struct|enum|trait|type|const|static|union|macro_rules!)\s+"
                         + re.escape(rest[0]) + r"\b", self.text[path]):
                return path
            for glob in imp.get("*", []):
                target = self.resolve(glob + rest, seen)
                if target is not None and target != self.files.get(tuple(glob)):
                    return target
            return path
        return None

    def inline_mods(self, text):
        """[(start, end, names)]: the spans of inline `mod x { ... }` blocks."""
        spans = []
        for m in re.finditer(r"\bmod\s+(" + IDENT + r")\s*\{", text):
            depth, j = 1, m.end()
            while j < len(text) and depth:
                depth += (text[j] == "{") - (text[j] == "}")
                j += 1
            spans.append((m.start(), j, m.group(1)))
        return spans

    def mod_at(self, mod, spans, pos):
        inner = [s for s in spans if s[0] <= pos < s[1]]
        return tuple(mod) + tuple(name for _, _, name in sorted(inner))

    def edges(self):
        """(from file, to file) -> first line number of a use.

        `pub use` (re-exports, any visibility) are not edges: a module that
        re-exports its child's item does not depend on it.
        """
        found = {}
        path_re = re.compile(r"(?<![A-Za-z0-9_:$])((?:crate|self|super|" + IDENT + r")(?:::" + IDENT + r")+)")
        for path, text in self.text.items():
            mod = self.mods[path]
            inline = self.inline_mods(text)
            spans = []
            for m in re.finditer(r"(\bpub(?:\([^)]*\))?\s+)?\buse\s+([^;]+);", text):
                if m.group(1):
                    continue
                line = text.count("\n", 0, m.start()) + 1
                for segs, _ in expand_use_tree(m.group(2)):
                    spans.append((line, self.mod_at(mod, inline, m.start()), segs))
            body = re.sub(r"\buse\s+[^;]+;", lambda m: " " * (len(m.group(0)) - m.group(0).count("\n"))
                          + "\n" * m.group(0).count("\n"), text)
            for m in path_re.finditer(body):
                here = self.mod_at(mod, inline, m.start())
                segs = m.group(1).split("::")
                if segs[0] not in ("crate", "self", "super") and segs[0] not in self.children(here):
                    continue
                spans.append((body.count("\n", 0, m.start()) + 1, here, segs))
            for line, here, segs in spans:
                if self.no_tests and "tests" in here:
                    continue
                if segs and segs[-1] == "*":
                    segs = segs[:-1]
                a = self.absolute(here, segs)
                if a is None:
                    continue
                target = self.resolve(a)
                if target and target != path:
                    found.setdefault((path, target), line)
        return found


def sccs(nodes, adj):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in adj.get(v, ()):
            if w not in index:
                visit(w)
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
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in nodes:
        if v not in index:
            visit(v)
    return out


def shortest_cycle(comp, adj, start):
    """A shortest cycle through `start` inside `comp` (BFS)."""
    comp = set(comp)
    prev = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(adj.get(v, ())):
            if w not in comp:
                continue
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return [start]


def workspace_crates(top):
    crates = []
    for dirpath, dirnames, names in os.walk(top):
        dirnames[:] = [d for d in dirnames if d not in ("target", ".git", "node_modules")
                       and not d.startswith(".")]
        if "Cargo.toml" in names and os.path.isdir(os.path.join(dirpath, "src")):
            crates.append(dirpath)
    return sorted(crates)


def main(argv):
    top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    no_tests = "--no-tests" in argv
    roots = [a for a in argv[1:] if a != "--no-tests"] or workspace_crates(top)
    total = 0
    for root in roots:
        crate = Crate(root, no_tests)
        edges = crate.edges()
        adj = {}
        for (a, b) in edges:
            adj.setdefault(a, set()).add(b)
        for comp in sccs(sorted(crate.text), adj):
            if len(comp) < 2:
                continue
            total += 1
            rel = lambda p: os.path.relpath(p, top)
            print(f"cycle in {os.path.relpath(root, top)}: {len(comp)} files")
            for f in sorted(comp):
                print(f"  {rel(f)}")
            cyc = shortest_cycle(comp, adj, sorted(comp)[0])
            for a, b in zip(cyc, cyc[1:]):
                print(f"    {rel(a)}:{edges[(a, b)]} uses {rel(b)}")
    print(f"{total} import cycle(s)")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
