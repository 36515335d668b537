"""The HTTP side of the controller: the engine facade the HTTP thread calls, the typed commands it sends
to the control loop, and what the loop publishes back (readiness, health, /cluster, the stats line)."""
