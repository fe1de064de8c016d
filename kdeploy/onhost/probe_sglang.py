"""What the host's SGLang offers a payload (version, plugin loader, hook registry, allocators, attention
registry), read from SGLang's sources: never imports sglang.

Runs on the host under the service's python (any 3.8+), stdlib only, sent as ``python -I -c <this file>
[cache]``. ``cache``: a file where it keeps what it found for as long as the sources it read do not
change. Prints one ``KDEPLOY_PROBE {json}`` line (``kdeploy.core.probe.parse_probe`` reads it).
"""

import ast
import json
import os
import sys

CHOICES = (("srt", "arg_groups", "choices.py"), ("srt", "server_args.py"))
READ = [(), ("version.py",), ("srt", "plugins", "__init__.py"), ("srt", "plugins", "hook_registry.py"),
        ("srt", "layers", "attention", "attention_registry.py"), ("srt", "mem_cache", "allocator"), *CHOICES]


def src(root, *parts):
    p = os.path.join(root, *parts)
    try:
        with open(p, "rb") as f:
            return ast.parse(f.read(), p)
    except (OSError, SyntaxError, ValueError):
        return None


def names(tree, kind):
    return {n.name for n in ast.walk(tree) if isinstance(n, kind)} if tree else set()


def strings(tree):
    if not tree:
        return set()
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def stamp(root, parts):
    try:
        st = os.stat(os.path.join(root, *parts))
        return [st.st_mtime_ns, st.st_size, st.st_ino]
    except OSError:
        return None


def inspect(root, allocator_files):
    found = {}
    try:
        from importlib.metadata import version
        found["version"] = version("sglang")
    except Exception:
        tree = src(root, "version.py")
        found["version"] = next(iter(sorted(s for s in strings(tree) if s[:1].isdigit())), None)
    plugins = src(root, "srt", "plugins", "__init__.py")
    found["plugin_loader"] = ("load_plugins" in names(plugins, ast.FunctionDef)
                              and "sglang.srt.plugins" in strings(plugins))
    hooks = src(root, "srt", "plugins", "hook_registry.py")
    found["hook_registry"] = "HookRegistry" in names(hooks, ast.ClassDef) and "around" in strings(hooks)
    allocators = []
    for parts in allocator_files:
        tree = src(root, *parts)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)) if tree else ():
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    args = fn.args.args + fn.args.kwonlyargs
                    if any(a.arg == "need_sort" for a in args) and cls.name not in allocators:
                        allocators.append(cls.name)
    found["allocators"] = allocators
    reg = src(root, "srt", "layers", "attention", "attention_registry.py")
    found["attention_registry"] = "register_attention_backend" in names(reg, ast.FunctionDef)
    found["triton_backend"] = found["attention_registry"] and "triton" in strings(reg)
    found["backend_choices"] = None
    for parts in CHOICES:
        tree = src(root, *parts)
        assigned = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)} if tree else set()
        if "add_attention_backend_choices" in assigned | names(tree, ast.FunctionDef):
            found["backend_choices"] = "sglang." + ".".join(parts)[:-3].replace(os.sep, ".")
            break
    return found


def cached_inspect(root, cache):
    """``inspect``, or what the last run found while none of the files it read changed (a reinstall changes
    them all): parsing SGLang's sources is most of the probe's ~0.15 s of CPU, paid again by every push of
    every host otherwise."""
    files = []
    adir = os.path.join(root, "srt", "mem_cache", "allocator")
    if os.path.isdir(adir):
        files = [("srt", "mem_cache", "allocator", f) for f in sorted(os.listdir(adir)) if f.endswith(".py")]
    files += [("srt", "mem_cache", "allocator.py"), ("srt", "mem_cache", "memory_pool.py")]
    key = [sys.executable, sys.version, root] + [stamp(root, parts) for parts in READ + files]
    try:
        with open(cache) as f:
            saved = json.load(f)
        found = saved["found"] if saved["key"] == key else None
    except (OSError, ValueError, KeyError, TypeError):
        found = None
    if found is None:
        found = inspect(root, files)
        if cache and os.path.isdir(os.path.dirname(cache)):
            try:
                with open("%s.%d" % (cache, os.getpid()), "w") as f:
                    json.dump({"key": key, "found": found}, f)
                os.replace("%s.%d" % (cache, os.getpid()), cache)
            except OSError:
                pass
    return found


def main(argv):
    out = {"python": sys.executable, "python_version": "%d.%d.%d" % sys.version_info[:3], "installed": False}
    try:
        import importlib.util
        spec = importlib.util.find_spec("sglang")
    except Exception as exc:
        spec = None
        out["error"] = "%s: %s" % (type(exc).__name__, exc)
    if spec is not None and spec.submodule_search_locations:
        root = list(spec.submodule_search_locations)[0]
        out["installed"] = True
        out["path"] = root
        out.update(cached_inspect(root, argv[1] if len(argv) > 1 else ""))
    print("KDEPLOY_PROBE " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv)
