rule prepare:
    input:
        **stage_inputs("prepare"),
    output:
        **stage_outputs("prepare"),
    params:
        **stage_params("prepare"),
    threads: stage_threads("prepare")
    conda:
        "../envs/asrflow.yaml"
    log:
        "logs/prepare.log",
    shell:
        stage_shell("prepare")
