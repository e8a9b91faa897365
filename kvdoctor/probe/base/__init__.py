"""What every floor of the probe stands on: the narrow context roles and ledgers get
(`context.ProbeContext`), the emitter, the settings, call sites, object walks, the ledger's
vocabulary shared with the native path. Imports nothing of the probe above it."""
