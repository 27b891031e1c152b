"""Tools for testing a RollArt deployment, shared by tests/ and benchmarks/.

- `ports.free_ports`: loopback ports that were free a moment ago;
- `topology.TopologyBuilder`: a topology built in code (nodes on free ports, `run` overrides) and
  written as YAML, instead of YAML assembled with f-strings;
- `proxy.PartitionProxy`: a TCP forwarder that cuts the network between roles;
- `push.push_once`: one weight push over loopback, publisher to receiver, in one process;
- `batches`: packed training batches, a fixed synthetic one and random ones of any shape;
- `harness.ChaosRun`: fault injection into a real training run, and `outcome`'s checks that
  nothing was lost or trained twice.

The top layer, like `rollart.launch`: it may import anything in rollart, and nothing in rollart
imports it.
"""
