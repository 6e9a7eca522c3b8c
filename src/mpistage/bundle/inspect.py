"""What a bundle holds, from its manifest alone: :func:`mpistage.inspect`."""


def largest(manifest, count=10):
    """Return the *count* largest file members, biggest first."""
    files = [m for m in manifest["members"] if m["type"] == "file"]
    return sorted(files, key=lambda m: m["size"], reverse=True)[:count]


def environment(manifest):
    """Return the line about packages, or about the packed environment."""
    env = manifest.get("env")
    if env:
        base = f" with base {env['base']}" if env.get("base") else ""
        libs = ", ".join(env["libraries"]) or "none"
        return [
            f"environment: {env['kind']} {env['prefix']}{base}",
            f"libraries from outside it: {libs}",
        ]
    return [f"packages: {', '.join(manifest['packages']) or '(whole directories)'}"]


def recorded(manifest):
    """Return the lines saying how a recorded bundle was learned, if it was."""
    info = manifest.get("recorded")
    if not info:
        return []
    import shlex

    command = shlex.join(str(a) for a in info.get("command", []))
    return [f"recorded: {command} (granularity {info.get('granularity')})"]


def render(manifest):
    """Return the summary of *manifest* as text."""
    from mpistage.runtime.format import original_path

    files = [m for m in manifest["members"] if m["type"] == "file"]
    py = manifest["python"]
    lines = [
        f"made by: mpistage {manifest['created_by']} {manifest.get('mpistage', '')}"
        f" on {manifest['created']}",
        *recorded(manifest),
        f"python: {py['implementation']} {py['version']} ({py['ext_suffix']})",
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
    return "\n".join(lines)


def inspect(bundle):
    """Return the checked manifest of *bundle* (reads its header and manifest only)."""
    from mpistage.runtime.format import read_manifest

    return read_manifest(bundle)
