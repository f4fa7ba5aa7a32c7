"""The topology file: what the user writes (model), its sections, the YAML reading and its
error lines, the EC connector names, and the proxy's key as written."""
