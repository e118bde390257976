"""Commands on capsules and the host store: new, ls, rm, verify, export, import, keygen, gc."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from capsulefs.agents import grants
from capsulefs.cli import UsageError
from capsulefs.cli.common import find_agent, host_id, new_agent_id, now_seconds, open_store, read_input_file, state_dir
from capsulefs.move.host import holders_dir, new_agent_files, record_imported, record_new_agent, refuse_stale_copy
from capsulefs.core.capsule import archive, signing
from capsulefs.core.errors import CapsuleError, SpecError
from capsulefs.core.capsule.format import Manifest
from capsulefs.core.store.agent import AgentHandle
from capsulefs.core.store.holder import HolderBook, HolderRecord
from capsulefs.core.store.story import story
from capsulefs.core.view.edit import MAX_EDIT_SIZE
from capsulefs.core.capsule.spec import default_spec, parse_spec

#: Largest ``--spec`` file ``new`` reads: what the mount lets a spec.json edit grow to.
MAX_SPEC_FILE = MAX_EDIT_SIZE


def cmd_new(args: argparse.Namespace) -> int:
    store = open_store(args)
    spec = default_spec()
    if args.spec:
        try:
            spec = parse_spec(read_input_file(args.spec, "--spec", MAX_SPEC_FILE))
        except SpecError as exc:
            raise SpecError(f"{args.spec}: {exc}") from None
    agent_id = new_agent_id()
    with new_agent_files(state_dir(args), agent_id):  # no daemon sees its files without its record
        agent = store.create_agent(args.name, host_id=host_id(args), agent_id=agent_id, spec=spec)
        if spec.get("secrets"):  # the operator wrote this spec: it may have what it asks (see grants)
            grants.grant(state_dir(args), agent_id, spec["secrets"])
        record_new_agent(state_dir(args), agent.agent_id, agent.manifest().holder.epoch)
    print(f"created agent {args.name} ({agent.agent_id})")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    """The agents of this host's store, each with its one story (``story.story``),
    and the agents it gave up whose copy it kept (under recovery/)."""
    from capsulefs.core.store.kept import kept_copies

    store = open_store(args)
    holders = HolderBook(holders_dir(state_dir(args)))
    rows = []
    for agent in store.agents():
        m = agent.manifest()
        told = story(holders.get(m.agent_id), m.name)
        rows.append({"name": m.name, "agent_id": m.agent_id, "holder": m.holder.host, "epoch": m.holder.epoch,
                     "blobs": len(m.blobs()), **told.as_json(), "line": told.line()})
    present = {r["agent_id"] for r in rows}
    for agent_id in holders.agent_ids():
        rec = holders.get(agent_id)
        if agent_id in present or rec is None or not rec.kept:
            continue
        copies = kept_copies(store.root, agent_id)
        try:
            with open(os.path.join(store.root, rec.kept, "manifest.json"), "rb") as f:
                m = Manifest.from_bytes(f.read())
        except (OSError, CapsuleError):
            continue  # (the copy was moved away by hand: nothing to show)
        told = story(rec, m.name)
        rows.append({"name": m.name, "agent_id": agent_id, "holder": m.holder.host, "epoch": m.holder.epoch,
                     "blobs": len(m.blobs()), **told.as_json(), "line": told.line(), "kept": len(copies)})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['name']:<24} {r['agent_id']}  epoch {r['epoch']}  {r['blobs']} blob(s)  {r['line']}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    """Remove an agent: through the daemon serving the state directory if one
    runs (it stops the agent's process and drops it from the mount), else
    here; either way refused while the agent is in a move (capsulefs.agents.removal)."""
    from capsulefs.core.store.holder import HolderBook
    from capsulefs.daemon.daemon import find_daemon, holding_state, work_dir
    from capsulefs.move.host import holders_dir
    from capsulefs.agents.removal import refuse_if_moving, remove_offline

    state = state_dir(args)
    store = open_store(args)
    agent = store.find(args.agent)
    name, agent_id = agent.name, agent.agent_id
    holders = HolderBook(holders_dir(state))
    running = find_daemon(state)
    if running is not None:
        refuse_if_moving(holders, agent_id, name)  # the daemon checks again; this names the move
        _remove_through_daemon(str(running["mountpoint"]), name, agent_id)
    else:
        # No daemon may start (and run the agent) while its files go.
        with holding_state(state, doing=f"removing {name} without a daemon"):
            remove_offline(state, work_dir(state), store, holders, agent_id)
    print(f"removed agent {name} ({agent_id})")
    if not args.keep_blobs:
        report = store.gc()  # beside a daemon too: gc and writers share the store's lock
        if report.removed:
            print(f"freed {report.removed} unreferenced blob(s), {report.freed} bytes")
    return 0


#: errno of a refused ``.control/remove`` write -> why, in words (docs/mount.md).
_REMOVE_ERRORS = {
    errno.EBUSY: "a move of it is under way",
    errno.EROFS: "the mount went read-only after an internal error",
    errno.EACCES: "only the mounting user and root may remove agents through the mount",
    errno.EINVAL: "the daemon did not take the agent's id",
    errno.ENOENT: "the mount no longer shows it",
    errno.EOPNOTSUPP: "this daemon cannot remove agents",
}


def _remove_through_daemon(mountpoint: str, name: str, agent_id: str) -> None:
    """Write the agent's id to its ``.control/remove`` and wait for the answer."""
    control = os.path.join(mountpoint, name, ".control")
    try:
        with open(os.path.join(control, "remove"), "w") as f:
            f.write(agent_id + "\n")
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0, "?")
        why = _REMOVE_ERRORS.get(exc.errno or 0, exc.strerror or str(exc))
        raise CapsuleError(f"agent {name} ({agent_id}) not removed: the daemon serving {mountpoint} refused: "
                           f"{why} [{code}] (see {control}/status and the daemon's log)") from None


def cmd_verify(args: argparse.Namespace) -> int:
    pubkey = None
    if args.pubkey:
        with open(args.pubkey, "rb") as f:
            pubkey = f.read()
    manifest, problems = archive.verify_capsule(args.path, pubkey=pubkey)
    for p in problems:
        print(f"{args.path}: {p}", file=sys.stderr)
    if problems:
        print(f"FAILED: {len(problems)} problem(s) in {args.path}", file=sys.stderr)
        return 1
    assert manifest is not None
    what = f"OK: {args.path} ({manifest.name}, {manifest.agent_id}, {len(manifest.files)} files)"
    if pubkey:
        print(f"{what} and its signature verified")
    else:  # the digests alone say the files match the manifest, not who wrote the manifest
        print(f"{what} verified; its origin is not checked without --pubkey (a capsule rewritten whole, "
              f"manifest included, passes too)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    agent = find_agent(args, args.agent)
    key = None
    if args.sign:
        with open(args.sign, "rb") as f:
            key = f.read()
        signing.load_private_key(key, args.sign)  # fail before writing anything
    with _evicted_fetched(args, agent):
        archive.export_agent(agent, args.output, mtime=now_seconds(), sign_key=key)
    print(f"exported {agent.name} to {args.output}{' (signed)' if key else ''}")
    return 0


@contextmanager
def _evicted_fetched(args: argparse.Namespace, agent: AgentHandle) -> Iterator[None]:
    """On a host with a blob tier: the agent's blobs that ``gc --tier-cache``
    evicted are fetched back from the tier (verified, stored durably), and its
    manifest stays in a staging area until the block ends, so that no gc
    evicts them meanwhile. Without a tier: nothing (a missing blob is lost)."""
    from capsulefs.core.fleet import config as fleet_config

    cfg = fleet_config.load(state_dir(args))
    if cfg is None or cfg.tier is None:
        yield
        return
    import trio

    from capsulefs.fleet.cache import host_tier_cache

    store = agent.store
    manifest = agent.manifest()
    with store.keeping(manifest, "export"):
        sizes = manifest.blobs()
        if any(not store.has_blob(sha) for sha in sizes):
            async def fetch() -> None:
                async with host_tier_cache(store) as cache:
                    assert cache is not None  # (fleet.json names a tier)
                    await cache.ensure_local(sizes)

            trio.run(fetch)
        yield


def cmd_import(args: argparse.Namespace) -> int:
    store = open_store(args)
    state, here = state_dir(args), host_id(args)
    records: list[HolderRecord] = []

    @contextmanager
    def installing(manifest: Manifest) -> Iterator[None]:
        with new_agent_files(state, manifest.agent_id):  # no daemon sees its files without its record
            refuse_stale_copy(state, manifest.agent_id, manifest.name, manifest.holder.host, manifest.holder.epoch,
                              here)
            yield
            if manifest.holder.host == here:
                records.append(record_new_agent(state, manifest.agent_id, manifest.holder.epoch))
            else:
                # A copy of an agent another host holds: running it here could
                # run it twice. In doubt until peers answer or an operator decides.
                records.append(record_imported(state, manifest.agent_id, manifest.holder.host,
                                               manifest.holder.epoch))

    agent = archive.import_tar(store, args.tar, installing=installing)
    print(f"imported agent {agent.name} ({agent.agent_id})")
    print(f"{agent.name}: {story(records[0] if records else None, agent.name).line()}")
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    priv, pub = signing.generate_keypair(args.output)
    print(f"wrote private key {priv} (mode 0600) and public key {pub}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    if args.tier_cache is None:
        report = open_store(args).gc()
        print(f"removed {report.removed} blob(s), freed {report.freed} bytes, kept {report.kept}")
        return 0
    from capsulefs.core.store.cache import parse_size

    limit = parse_size(args.tier_cache)
    tier = _tier_url(args, "gc --tier-cache")
    from capsulefs.fleet.cache import EvictionPolicy
    from capsulefs.fleet.live import EvictionRecord

    store = open_store(args)
    report, cache = store.gc_tier_cache(limit, EvictionPolicy(EvictionRecord(store.root, tier)))
    print(f"removed {report.removed} blob(s), freed {report.freed} bytes, kept {report.kept}")
    print(f"evicted {cache.evicted} blob(s) held by the blob tier, freed {cache.evicted_bytes} bytes; "
          f"cache: {cache.cached_bytes} bytes of listed blobs kept here (limit {cache.limit})")
    if cache.over:
        print(f"capsulefs: warning: the blobs kept here are {cache.cached_bytes} bytes, over the limit of "
              f"{cache.limit}: the rest are not yet known to be in the blob tier, or a move or an export "
              f"in flight uses them", file=sys.stderr)
    return 0


def _tier_url(args: argparse.Namespace, what: str) -> str:
    """The blob tier this host's fleet.json names (as the record of what it holds names it)."""
    from capsulefs.core.fleet import config as fleet_config

    cfg = fleet_config.load(state_dir(args))
    if cfg is None or cfg.tier is None:
        raise UsageError(f"{what}: this host has no blob tier ({fleet_config.config_path(state_dir(args))} names "
                         f"none: a mount with --blobs saves it)")
    return str(cfg.tier)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("new", help="create a new agent in the host store")
    p.add_argument("name", help="display name (also its directory name in a mount)")
    p.add_argument("--spec", metavar="FILE", help="environment spec JSON to start from")
    p.set_defaults(func=cmd_new)

    p = sub.add_parser("ls", help="list the agents this host holds")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("rm", help="remove an agent from this host (and free its unshared blobs)")
    p.add_argument("agent", help="agent name or id")
    p.add_argument("--keep-blobs", action="store_true", help="do not garbage-collect afterwards")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("verify", help="verify a capsule directory or tar; exit 0 if it verifies, 1 if not")
    p.add_argument("path", help="capsule directory, or .tar / .tar.gz / .tar.zst")
    p.add_argument("--pubkey", metavar="FILE", help="also require a valid signature by this public key")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("export", help="export an agent to a capsule tar")
    p.add_argument("agent", help="agent name or id")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="FILE.tar, FILE.tar.gz (.tgz) or FILE.tar.zst; any other name is refused")
    p.add_argument("--sign", metavar="KEYFILE", help="sign the manifest with this Ed25519 private key")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", help="import a capsule tar (verified first; all or nothing)")
    p.add_argument("tar")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("keygen", help="make an Ed25519 signing key pair")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="private key file; the public key goes to FILE.pub")
    p.set_defaults(func=cmd_keygen)

    p = sub.add_parser("gc", help="delete blobs that no agent references")
    p.add_argument("--tier-cache", metavar="SIZE",
                   help="on a host with a blob tier: also delete local copies of blobs the tier holds, least "
                        "recently read first, until the listed blobs kept here fit SIZE (like 10G, 500M); "
                        "readers fetch them back")
    p.set_defaults(func=cmd_gc)


__all__ = ["register", "CapsuleError"]
