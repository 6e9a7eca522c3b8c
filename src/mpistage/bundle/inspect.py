"""What a bundle holds, from its manifest alone: :func:`mpistage.inspect`.

A bundle is untrusted input, and its names go to a terminal: :func:`render`
escapes every character that is not printable (``\\x1b`` for an escape
sequence), and takes any field it shows as text, whatever its type.
"""


def largest(manifest, count=10):
    """Return the *count* largest file members, biggest first."""
    files = [m for m in manifest["members"] if m["type"] == "file"]
    return sorted(files, key=lambda m: m["size"], reverse=True)[:count]


def environment(manifest):
    """Return the line about packages, or about the packed environment."""
    env = manifest.get("env")
    if env:
        base = f" with base {env['base']}" if env.get("base") else ""
        libs = ", ".join(map(str, env.get("libraries") or [])) or "none"
        return [
            f"environment: {env.get('kind')} {env.get('prefix')}{base}",
            f"libraries from outside it: {libs}",
        ]
    packages = ", ".join(map(str, manifest.get("packages") or []))
    lines = [f"packages: {packages or '(whole directories)'}"]
    if manifest.get("libraries"):
        libs = ", ".join(map(str, manifest["libraries"]))
        lines.append(f"libraries from other distributions: {libs}")
    return lines


def recorded(manifest):
    """Return the lines saying how a recorded bundle was learned, if it was."""
    info = manifest.get("recorded")
    if not info:
        return []
    import shlex

    command = shlex.join(str(a) for a in info.get("command", []))
    return [f"recorded: {command} (granularity {info.get('granularity')})"]


def printable(text):
    """Return *text* with every unprintable character escaped, as ``repr`` does."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def render(manifest):
    """Return the summary of *manifest* as text, safe for a terminal."""
    return "\n".join(printable(line) for line in summary(manifest))


def summary(manifest):
    """Return the lines of the summary of *manifest*, as the manifest says."""
    from mpistage.runtime.bundlefile import original_path

    files = [m for m in manifest["members"] if m["type"] == "file"]
    py = manifest["python"]
    return [
        f"made by: mpistage {manifest.get('created_by')} "
        f"{manifest.get('mpistage', '')} on {manifest.get('created')}",
        *recorded(manifest),
        f"python: {py.get('implementation')} {py.get('version')} "
        f"({py.get('ext_suffix')})",
        *environment(manifest),
        "roots:",
        *(
            f"  r{i} {root['path']}"
            for i, root in enumerate(manifest["roots"])
            if any(m["root"] == i for m in manifest["members"])
        ),
        f"files: {len(files)}, bytes: {sum(m['size'] for m in files)}",
        "largest:",
        *(
            f"  {m['size']:>12}  {original_path(manifest, m)}"
            for m in largest(manifest)
        ),
    ]


def inspect(bundle):
    """Return the checked manifest of *bundle* (reads its header and manifest only)."""
    from mpistage.runtime.read import read_manifest

    return read_manifest(bundle)
