rule evaluate:
    input:
        **stage_inputs("evaluate"),
    output:
        **stage_outputs("evaluate"),
    params:
        **stage_params("evaluate"),
    threads: stage_threads("evaluate")
    conda:
        "../envs/asrflow.yaml"
    log:
        "logs/evaluate.log",
    shell:
        stage_shell("evaluate")
