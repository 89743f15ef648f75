"""Which experts to load before the gate asks: predictors (`predictors`: correlation
table, next-gate, frequency), the tables they learn (`cooccurrence`) and where a model's
table is kept and how it is learned from a job (`correlate`)."""
