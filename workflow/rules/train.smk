rule train:
    input:
        **stage_inputs("train"),
    output:
        **stage_outputs("train"),
    params:
        **stage_params("train"),
    threads: stage_threads("train")
    conda:
        "../envs/asrflow.yaml"
    log:
        "logs/train.log",
    shell:
        stage_shell("train")
