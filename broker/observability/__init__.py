"""What operators read from a running process: metrics, traces and logs."""
