"""capsulefs.mount: the thin pyfuse3 adapter over capsulefs.core."""
