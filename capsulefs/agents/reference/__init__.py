"""The reference agent: ``capsulefs agent``, the default entrypoint of a spec (see ``loop``)."""
