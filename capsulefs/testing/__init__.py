"""Test seams and stand-ins, imported by tests and demos, never by the daemon's own paths.

  * ``stub_provider``: a local stand-in for the model providers' HTTP APIs
    (``python -m capsulefs.testing.stub_provider --port N``).
  * ``fleet_sim``: a fleet on the sans-IO core with a simulated etcd
    (the hypothesis test, ``bench/bench_fleet_sim.py``).
"""
