"""The training side: LightningModules (Llama/MoE, Hugging Face models), callbacks and run services
(metrics, stragglers, preemption, profiling)."""
