"""What several test modules share: the small least-squares problem, the float64 NumPy reference of DC-ASGD's server,
the HLO inventory of compiled programs."""
