"""The capsule: its format, and what reads or writes a whole capsule.

  * ``format``: the one canonical definition of ``capsule/1`` (files, manifest, names).
  * ``spec``: ``environment/spec.json``; ``workspace``: ``artifacts/snapshot.json``
    and the workspace it describes.
  * ``verify``: scanning and checking a capsule, directory or tar.
  * ``tarball``: safe reading and writing of capsule tars; ``archive``: export
    from and import into the host store; ``merge``: two diverged copies made one;
    ``signing``: Ed25519 over an exported manifest.
"""
