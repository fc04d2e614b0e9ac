"""The Ray side of a job: the worker actor, the worker group, and the cluster view.

Workers answer calls and publish progress; they never reach back into the controller.
The runtime never imports backfill (the group takes its executor factory as a sidecar).
"""
