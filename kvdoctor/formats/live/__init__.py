"""What a running `kvdoctor watch` puts out as it samples: the live table (view), the Prometheus
endpoint (prometheus), and its summary at the end (summary). Apart from kvdoctor.formats.reports,
which render a finished Analysis and know nothing of a live sampler."""
