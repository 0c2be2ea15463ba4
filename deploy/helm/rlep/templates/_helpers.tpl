{{/* Names, labels and the pieces every RLEP pod shares. */}}

{{- define "rlep.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
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

{{- define "rlep.secretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-secrets" (include "rlep.fullname" .)) -}}
{{- end -}}

{{- define "rlep.configName" -}}
{{- printf "%s-config" (include "rlep.fullname" .) -}}
{{- end -}}

{{- define "rlep.verifierAddress" -}}
{{ include "rlep.fullname" . }}-verifier:50061
{{- end -}}

{{- define "rlep.replayAddress" -}}
{{ include "rlep.fullname" . }}-replay:50062
{{- end -}}

{{/* The RayService's head Service (KubeRay keeps it pointed at the serving cluster): Ray client port. */}}
{{- define "rlep.rayClientAddress" -}}
ray://{{ include "rlep.fullname" . }}-rollout-head-svc:10001
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

{{/* A gRPC Deployment's probes: the health service needs no token. Argument: (dict "port" 50061 "tls" bool).
The kubelet's gRPC probe speaks plaintext only, so with TLS the probes check that the port accepts connections. */}}
{{- define "rlep.grpcProbes" -}}
{{- $probe := ternary (dict "tcpSocket" (dict "port" .port)) (dict "grpc" (dict "port" .port)) .tls }}
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
Init container writing <out> = <base> with the rollout replicas' addresses at <key>, read from the
RayService's registry. Argument: (dict "root" $ "key" "endpoints.rollout" "config" "train.yaml")
The pod needs the volumes from "rlep.resolveVolumes"; the main container reads /run/rlep/<config>.
*/}}
{{- define "rlep.resolveRollout" -}}
- name: resolve-rollout
  image: {{ include "rlep.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command:
    - python
    - /etc/rlep/scripts/resolve_rollout.py
    - --ray-address={{ include "rlep.rayClientAddress" .root }}
    - --app={{ .root.Values.rollout.appName }}
    - --expect={{ .root.Values.rollout.replicas }}
    - --key={{ .key }}
    - --base=/etc/rlep/config/{{ .config }}
    - --out=/run/rlep/{{ .config }}
  {{- with include "rlep.tlsEnv" .root | fromYamlArray }}
  # It health-checks the replicas (over TLS when on) before writing their addresses.
  env:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml .root.Values.securityContext | nindent 4 }}
  volumeMounts:
    - { name: config, mountPath: /etc/rlep/config, readOnly: true }
    - { name: scripts, mountPath: /etc/rlep/scripts, readOnly: true }
    - { name: resolved, mountPath: /run/rlep }
    {{- include "rlep.tlsMount" .root | nindent 4 }}
{{- end -}}

{{- define "rlep.resolveVolumes" -}}
- name: resolved
  emptyDir: {}
- name: scripts
  configMap:
    name: {{ include "rlep.fullname" . }}-scripts
{{- end -}}
