"""The agent's semantic index, ``memory/vector_index/index.json`` (search, recall).

Named ``semantic`` rather than ``index``: the journal's envelope index and the
timeline's index are indexes too.

  * ``index``: updating, merging and searching the index (derived from the journal).
  * ``text``: what is embedded and how it is cut into chunks.
  * ``vectors``: the vectors in memory and the index file; ``embedders``: text to vectors.
  * ``access``: reading one agent's capsule files for the index, replacing its index.json.
"""
