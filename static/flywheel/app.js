// Flywheel UI behaviour (no inline script: the CSP forbids it).
