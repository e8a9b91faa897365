"""Everything kvdoctor writes for a person or another program, under one roof, and one table of it
(table): reports of a finished analysis and a gate's verdict (reports), what a running watch and
`--metrics` show (live), attribution windows as pprof profiles (pprof) and a trace's counters as a
table (counter_table). The four know nothing of each other; each stands on the table."""
