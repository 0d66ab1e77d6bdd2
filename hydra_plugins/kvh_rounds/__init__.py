"""`hydra/sweeper=kvh_rounds` (conf/hydra/sweeper/kvh_rounds.yaml): a multirun in sequential
rounds (harness.sweep.rounds). Hydra only instantiates sweepers defined under the `hydra_plugins`
package, hence this module."""
