"""The Ray side of a job: the worker actor, the worker group (`group`) and what it
publishes (`progress`: the interface the controller drives), where workers go
(`placement`), the replicas one group hands the next (`survivors`), the cluster view,
the autoscaler demand, the state keepers (`keeper`: peer copies of the ranks'
state in live nodes' memory; `peers`: placing them, sending to them, reading from
them), and the ranks' stacks read from their nodes (`stacks`).

Workers answer calls and publish progress; they never reach back into the controller.
The runtime never imports backfill (the group takes its executor factory as a sidecar).
"""
