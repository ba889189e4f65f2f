"""What every process shares: configuration, tokens, supervision of background tasks, the
HTTP servers' error guard, span redaction."""
