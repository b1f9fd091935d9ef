rule tokenizer:
    input:
        **stage_inputs("tokenizer"),
    output:
        **stage_outputs("tokenizer"),
    params:
        **stage_params("tokenizer"),
    threads: stage_threads("tokenizer")
    conda:
        "../envs/asrflow.yaml"
    log:
        "logs/tokenizer.log",
    shell:
        stage_shell("tokenizer")
