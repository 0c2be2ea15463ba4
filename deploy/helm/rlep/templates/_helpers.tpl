{{/* Names, labels and the pieces every RLEP pod shares. */}}

{{/* The prefix of every name. At most 39 characters: the RayService is <fullname>-rollout and KubeRay refuses
RayService names over 47 (MaxRayServiceNameLength). Refused rather than truncated, which could make two
releases share names. */}}
{{- define "rlep.fullname" -}}
{{- $name := ternary .Release.Name (printf "%s-%s" .Release.Name .Chart.Name) (contains .Chart.Name .Release.Name) -}}
{{- if gt (len $name) 39 -}}
{{- fail (printf "the names of this release start with %q (%d characters); at most 39 fit KubeRay's 47-character RayService name (<name>-rollout): use a shorter release name" $name (len $name)) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{- define "rlep.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rlep
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "verifier") */}}
{{- define "rlep.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "rlep.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The image of a pod with GPUs (deploy/docker/Dockerfile.gpu): the CPU image's vLLM cannot use them. */}}
{{- define "rlep.gpuImage" -}}
{{- $tag := .Values.image.gpuTag | default (printf "%s-gpu" (.Values.image.tag | default .Chart.AppVersion)) -}}
{{ .Values.image.gpuRepository | default .Values.image.repository }}:{{ $tag }}
{{- end -}}

{{/* A Kubernetes quantity (4Gi, 512Mi, 2G, 1e9, "1073741824") in whole MiB, for the chart's sizing checks. */}}
{{- define "rlep.mib" -}}
{{- $q := toString . -}}
{{- $factors := dict "Ki" 0.0009765625 "Mi" 1.0 "Gi" 1024.0 "Ti" 1048576.0 "k" 0.00095367431640625 "M" 0.95367431640625 "G" 953.67431640625 "T" 953674.31640625 -}}
{{- $unit := regexFind "[a-zA-Z]+$" $q -}}
{{- if and $unit (not (hasKey $factors $unit)) -}}
{{- fail (printf "cannot size %q: use Ki, Mi, Gi, Ti, k, M, G or T" $q) -}}
{{- end -}}
{{- $number := float64 (trimSuffix $unit $q) -}}
{{- if $unit -}}{{- mulf $number (get $factors $unit) | floor | int64 -}}{{- else -}}{{- divf $number 1048576.0 | floor | int64 -}}{{- end -}}
{{- end -}}

{{/* Guaranteed QoS: requests == limits. Argument: (dict "cpu" "2" "memory" "8Gi" "gpus" 0) */}}
{{- define "rlep.guaranteed" -}}
{{- $amounts := dict "cpu" (toString .cpu) "memory" (toString .memory) -}}
{{- if gt (int .gpus) 0 }}{{- $_ := set $amounts "nvidia.com/gpu" (int .gpus) -}}{{- end -}}
{{- toYaml (dict "requests" $amounts "limits" $amounts) -}}
{{- end -}}

{{/* Where the starting checkpoint is inside the pods, or "" when model.volume is not set. */}}
{{- define "rlep.modelPath" -}}
{{- if .Values.model.volume -}}
{{- trimSuffix "/" (printf "/models/%s" (.Values.model.path | default "" | trimPrefix "/")) -}}
{{- end -}}
{{- end -}}

{{- define "rlep.rayAuthSecretName" -}}
{{- .Values.rollout.rayAuth.existingSecret | default (printf "%s-ray-auth" (include "rlep.fullname" .)) -}}
{{- end -}}

{{- define "rlep.secretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-secrets" (include "rlep.fullname" .)) -}}
{{- end -}}

{{- define "rlep.configName" -}}
{{- printf "%s-config" (include "rlep.fullname" .) -}}
{{- end -}}

{{- define "rlep.verifierAddress" -}}
{{ include "rlep.fullname" . }}-verifier:50061
{{- end -}}

{{- define "rlep.sandboxAddress" -}}
{{ include "rlep.fullname" . }}-sandbox:50064
{{- end -}}

{{- define "rlep.replayAddress" -}}
{{ include "rlep.fullname" . }}-replay:50062
{{- end -}}

{{/* The rollout replicas by DNS (NAME:PORT): a headless Service of the worker pods, each serving on rollout.port.
The learner and eval resolve it again before every step / job (services/rollout/discovery.py). */}}
{{- define "rlep.rolloutService" -}}
{{ include "rlep.fullname" . }}-rollout-replicas:{{ .Values.rollout.port }}
{{- end -}}

{{/* Where the auth token file is mounted in every RLEP container. */}}
{{- define "rlep.tokenPath" -}}
/etc/rlep/secrets/auth-token
{{- end -}}

{{/* The pod-level fields every RLEP pod shares: (dict "root" $ "component" .Values.verifier) */}}
{{- define "rlep.podPlacement" -}}
{{- $selector := merge (deepCopy (.component.nodeSelector | default dict)) .root.Values.nodeSelector -}}
{{- with $selector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $tolerations := concat (.root.Values.tolerations | default list) (.component.tolerations | default list) -}}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .component.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "rlep.tokenVolume" -}}
- name: auth-token
  secret:
    secretName: {{ include "rlep.secretName" . }}
    items:
      - key: auth-token
        path: auth-token
{{- end -}}

{{- define "rlep.configVolume" -}}
- name: config
  configMap:
    name: {{ include "rlep.configName" . }}
{{- end -}}

{{- define "rlep.commonMounts" -}}
- name: config
  mountPath: /etc/rlep/config
  readOnly: true
- name: auth-token
  mountPath: /etc/rlep/secrets
  readOnly: true
{{- include "rlep.tlsMount" . }}
{{- end -}}

{{/* TLS (values `tls`): the Secret's files in every RLEP container, the server fields that turn it on
and the client variables (rlep_common/tls.py). Each renders nothing while tls.secretName is empty. */}}
{{- define "rlep.tlsMount" -}}
{{- if .Values.tls.secretName }}
- name: tls
  mountPath: /etc/rlep/tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "rlep.tlsVolume" -}}
{{- if .Values.tls.secretName }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
{{- end }}
{{- end -}}

{{/* As YAML, for `fromYaml`: merge into a config's `server`. */}}
{{- define "rlep.tlsServerFields" -}}
{{- if .Values.tls.secretName }}
tls_cert_file: /etc/rlep/tls/tls.crt
tls_key_file: /etc/rlep/tls/tls.key
{{- end }}
{{- end -}}

{{- define "rlep.tlsEnv" -}}
{{- if .Values.tls.secretName }}
{{- if not .Values.tls.serverName }}
{{- fail "tls.secretName is set but tls.serverName is empty: name the certificate's DNS name (pods are dialled by IP)" }}
{{- end }}
- { name: RLEP_TLS_CA_FILE, value: /etc/rlep/tls/ca.crt }
- { name: RLEP_TLS_SERVER_NAME, value: {{ .Values.tls.serverName | quote }} }
{{- end }}
{{- end -}}

{{/* NCCL's settings for the pods that join a weight broadcast (learner, rollout workers): `nccl.socketIfname`
names the interface the nodes share (NCCL may pick another on multi-NIC nodes), `nccl.debug` its log level. */}}
{{- define "rlep.ncclEnv" -}}
{{- with .Values.nccl.socketIfname }}
- { name: NCCL_SOCKET_IFNAME, value: {{ . | quote }} }
{{- end }}
{{- with .Values.nccl.debug }}
- { name: NCCL_DEBUG, value: {{ . | quote }} }
{{- end }}
{{- end -}}

{{/* A gRPC Deployment's probes, on the service's health port (server.health_port, rlep_common/health_port.py):
plaintext, so the kubelet's gRPC probe (no TLS) works with TLS on, and answered by a server of its own, so a probe
does not wait behind the data port's calls; it says NOT_SERVING when the data port's own health check stalls.
Argument: (dict "port" 50071). */}}
{{- define "rlep.grpcProbes" -}}
{{- $probe := dict "grpc" (dict "port" .port) }}
startupProbe:
  {{- toYaml $probe | nindent 2 }}
  periodSeconds: 5
  failureThreshold: 60
readinessProbe:
  {{- toYaml $probe | nindent 2 }}
  periodSeconds: 10
livenessProbe:
  {{- toYaml $probe | nindent 2 }}
  periodSeconds: 20
  failureThreshold: 3
{{- end -}}

{{/*
Init container that waits until rollout.replicas replicas answer (files/wait_rollout.py): the replicas' headless
Service ("rlep.rolloutService") must resolve to that many addresses, and each must answer GetStatus with RLEP's
bearer token (over TLS when on), the check the learner makes before every step. No Ray client, no Ray token.
Argument: the root context. The pod needs the "scripts" volume ("rlep.scriptsVolume") and the "auth-token" one.
*/}}
{{- define "rlep.waitRollout" -}}
- name: wait-rollout
  image: {{ include "rlep.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - python
    - /etc/rlep/scripts/wait_rollout.py
    - --service={{ include "rlep.rolloutService" . }}
    - --expect={{ .Values.rollout.replicas }}
    - --wait-s={{ .Values.rollout.startupWaitSeconds }}
    - --token-file={{ include "rlep.tokenPath" . }}
  {{- with include "rlep.tlsEnv" . | fromYamlArray }}
  env:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    {{- include "rlep.guaranteed" (dict "cpu" "250m" "memory" "512Mi" "gpus" 0) | nindent 4 }}
  volumeMounts:
    - { name: scripts, mountPath: /etc/rlep/scripts, readOnly: true }
    - { name: auth-token, mountPath: /etc/rlep/secrets, readOnly: true }
    {{- include "rlep.tlsMount" . | nindent 4 }}
{{- end -}}

{{- define "rlep.scriptsVolume" -}}
- name: scripts
  configMap:
    name: {{ include "rlep.fullname" . }}-scripts
{{- end -}}

{{/*
The learner's TrainConfig as YAML (configmap.yaml writes it, learner.yaml hashes it): fields from values
(`learner.config`) over what the chart sets itself. data.train_files are learner.trainFiles under /data, the
data volume's mount; checkpoints go to /checkpoints/<run_id> on the checkpoint volume.
*/}}
{{- define "rlep.trainConfig" -}}
{{- $l := .Values.learner }}
{{- $token := include "rlep.tokenPath" . }}
{{- $files := list }}
{{- range $l.trainFiles }}
{{- if hasPrefix "/" . }}
{{- $files = append $files . }}
{{- else if not $l.dataVolume }}
{{- fail (printf "learner.trainFiles names %q relative to the data volume, but learner.dataVolume is empty" .) }}
{{- else }}
{{- $files = append $files (printf "/data/%s" .) }}
{{- end }}
{{- end }}
{{- $data := dict }}
{{- if $files }}{{- $_ := set $data "train_files" $files }}{{- end }}
{{- if not (or $files (dig "data" "train_files" list $l.config)) }}
{{- fail "learner.enabled needs training data: set learner.dataVolume and learner.trainFiles (parquet files on it)" }}
{{- end }}
{{- $runId := $l.config.run_id | default "rlep" }}
{{- $endpoints := dict "verifier" (include "rlep.verifierAddress" .) "replay" (include "rlep.replayAddress" .) "auth_token_file" $token }}
{{- if .Values.sandbox.enabled }}{{- $_ := set $endpoints "sandbox" (include "rlep.sandboxAddress" .) }}{{- end }}
{{- if $l.rolloutEndpoints }}{{- $_ := set $endpoints "rollout" $l.rolloutEndpoints }}
{{- else }}{{- $_ := set $endpoints "rollout_service" (include "rlep.rolloutService" .) }}{{- end }}
{{- $deepspeed := dict "num_processes" (int $l.processes) }}
{{- /* Ray resources of each DeepSpeed process in the pod's own Ray: the GPUs the pod was given. */ -}}
{{- $local := dict "learner_gpus" $l.gpusPerProcess }}
{{- $train := dict "run_id" $runId "endpoints" $endpoints "deepspeed" $deepspeed "local" $local "data" $data "checkpoint" (dict "dir" (printf "/checkpoints/%s" $runId)) "metrics_host" "0.0.0.0" "metrics_port" 9464 "metrics_linger_s" 60 }}
{{- with include "rlep.modelPath" . }}{{- $_ := set $train "model" . }}{{- end }}
{{- if .Values.tls.secretName }}{{- $_ := set $train "metrics_tls" (include "rlep.tlsServerFields" . | fromYaml) }}{{- end }}
{{- toYaml (mergeOverwrite $train (deepCopy $l.config)) }}
{{- end -}}

{{/*
The learner Job's pod template. Argument: (dict "root" $ "wait" bool "gpus" int "runDir" "/checkpoints/rlep"
"config" <rlep.trainConfig>). Start-up: a checkpoint in runDir made by this Job (a retried pod) is resumed;
one made by another Job (a reinstall over the kept volume, an upgrade that replaced the Job) is resumed only
with learner.resume=continue, else the pod exits 78 (the Job's podFailurePolicy ends it).
*/}}
{{- define "rlep.learnerPod" -}}
{{- $root := .root }}
{{- $l := $root.Values.learner }}
{{- $gpu := gt (int .gpus) 0 }}
metadata:
  labels:
    {{- include "rlep.selectorLabels" (dict "root" $root "component" "learner") | nindent 4 }}
  annotations:
    checksum/config: {{ .config | sha256sum }}
spec:
  restartPolicy: Never
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  {{- include "rlep.podPlacement" (dict "root" $root "component" $l) | nindent 2 }}
  {{- if .wait }}
  initContainers:
    # Start once the rollout replicas have loaded their model.
    {{- include "rlep.waitRollout" $root | nindent 4 }}
  {{- end }}
  containers:
    - name: learner
      image: {{ ternary (include "rlep.gpuImage" $root) (include "rlep.image" $root) $gpu }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      command:
        - sh
        - -c
        - >-
          run={{ .runDir | squote }};
          if [ -e "$run/latest" ]; then
          if [ -n "$JOB_UID" ] && [ "$(cat "$run/.job-uid" 2>/dev/null)" = "$JOB_UID" ]; then set -- --resume;
          elif [ "$RLEP_RESUME" = continue ]; then set -- --resume;
          else echo "$run holds a checkpoint of another learner Job (reinstall or upgrade): set learner.resume=continue to continue that run, or a new learner.config.run_id to start another" >&2; exit 78;
          fi;
          fi;
          mkdir -p "$run" && printf %s "$JOB_UID" > "$run/.job-uid" &&
          exec rlep train --config=/etc/rlep/config/train.yaml "$@"
      ports:
        - { name: metrics, containerPort: 9464 }
      env:
        - name: JOB_UID
          valueFrom: { fieldRef: { fieldPath: "metadata.labels['batch.kubernetes.io/controller-uid']" } }
        - { name: RLEP_RESUME, value: {{ $l.resume | quote }} }
        # The weight broadcast's group address (weight_sync.master_address auto): the pod's Ray is held to
        # loopback and would name 127.0.0.1, where no rollout pod finds the learner.
        - name: RLEP_NODE_ADDRESS
          valueFrom: { fieldRef: { fieldPath: status.podIP } }
        {{- with include "rlep.tlsEnv" $root | fromYamlArray }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- with include "rlep.ncclEnv" $root | fromYamlArray }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      resources:
        {{- include "rlep.guaranteed" (dict "cpu" $l.resources.cpu "memory" $l.resources.memory "gpus" .gpus) | nindent 8 }}
      volumeMounts:
        {{- include "rlep.commonMounts" $root | nindent 8 }}
        - { name: checkpoints, mountPath: /checkpoints }
        - { name: dshm, mountPath: /dev/shm }
        {{- if $l.dataVolume }}
        - { name: data, mountPath: /data, readOnly: true }
        {{- end }}
        {{- if $root.Values.model.volume }}
        - { name: model, mountPath: /models, readOnly: true }
        {{- end }}
  volumes:
    {{- include "rlep.configVolume" $root | nindent 4 }}
    {{- include "rlep.tokenVolume" $root | nindent 4 }}
    {{- include "rlep.tlsVolume" $root | nindent 4 }}
    - name: checkpoints
      {{- if $l.checkpoints.persistence.enabled }}
      persistentVolumeClaim: { claimName: {{ include "rlep.fullname" $root }}-learner-checkpoints }
      {{- else }}
      emptyDir: {}
      {{- end }}
    - name: dshm
      emptyDir: { medium: Memory, sizeLimit: {{ $l.shmSize }} }
    {{- if .wait }}
    {{- include "rlep.scriptsVolume" $root | nindent 4 }}
    {{- end }}
    {{- with $l.dataVolume }}
    {{- toYaml (list (merge (dict "name" "data") (deepCopy .))) | nindent 4 }}
    {{- end }}
    {{- with $root.Values.model.volume }}
    {{- toYaml (list (merge (dict "name" "model") (deepCopy .))) | nindent 4 }}
    {{- end }}
{{- end -}}
