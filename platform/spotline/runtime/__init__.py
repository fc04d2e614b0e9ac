"""The Ray side of a job: the worker actor, the worker group, the cluster view, and
the state keepers (`keeper`: peer copies of the ranks' state in live nodes' memory).

Workers answer calls and publish progress; they never reach back into the controller.
The runtime never imports backfill (the group takes its executor factory as a sidecar).
"""
