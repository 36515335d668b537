"""Default recovery times shared by the blast-radius table, the fleet simulation and the planner.

A whole-group restart of 20 minutes, an elastic pause of 1 minute, and the times for reloading
lost experts; every one is an option of the commands, to be
replaced with a deployment's measured figures.
"""

RESTART_MIN = 20.0  # whole-group restart: reload weights, capture graphs, warm up
PAUSE_MIN = 1.0  # elastic recovery: fence, re-place, resume
DISK_RELOAD_MIN = 5.0  # read the lost experts' tensors back from the checkpoint on disk
BACKUP_RELOAD_S = 10.0  # read them from the host-memory backup over the network
