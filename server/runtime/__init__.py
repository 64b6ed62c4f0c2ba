"""What a serving process runs on besides its front ends: logs, metrics, the graceful
shutdown, the garbage collector's settings, the cores it may use, its stdout and stderr."""
